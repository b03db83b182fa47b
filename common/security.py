"""Who may talk to a kvbridge process: its TLS files and the keys of its authenticated APIs.

One `Security` per process, set once at start-up (`rpc.configure`, from the command line's
flags) and used by every server and channel that process makes (common/rpc.py), its HTTP
front and its /metrics port; a node hands it to its rank processes, whose KV receivers and
senders are servers and channels too.

    --tls-cert FILE --tls-key FILE    every server presents this certificate (PEM); every
                                      channel presents it as its client certificate
    --tls-ca FILE                     mutual TLS: servers require a client certificate signed by
                                      this CA, and clients trust only servers signed by it
    --admin-key-file FILE             Admin calls need `authorization: Bearer KEY`
                                      (UNAUTHENTICATED without, PERMISSION_DENIED for another key)
    --api-key-file FILE (router)      Generation calls and the HTTP API need the same bearer
    --fleet-key-file FILE             the fleet key: what the processes of one fleet sign and check
                                      the KV hand-off with (routes, layouts, registrations); default:
                                      $KVBRIDGE_CACHE/fleet.key, made on first use, mode 0600
    --client-cert-reqs (router)       under --tls-ca, what the router's client-facing ports (HTTP
                                      API, gRPC Generation) ask of clients: required (as every
                                      fleet port), optional, or none (router/config.py)

Without flags nothing changes but the fleet key: plaintext, no keys (local development), and every
process of one user on one host shares the default fleet key file. Keys are compared in constant
time and never logged (their fields are left out of repr).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import hmac
import os
import secrets
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge.common.paths import cache_dir

MAX_KEY_BYTES = 4096  # a key file is one line
MIN_FLEET_KEY_CHARS = 32  # a fleet key file holds at least this many characters (`openssl rand -hex 32`: 64)
FLEET_KEY_FILE = "fleet.key"  # the default fleet key, in cache_dir()
# What a server asks of its clients under mutual TLS (a CA given): a certificate the CA signed
# (required), one checked only when presented (optional), or none. Fleet-internal ports require one.
CLIENT_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


@dataclass(frozen=True)
class Security:
    cert_file: str = ""  # PEM certificate chain this process presents ("" = no TLS)
    key_file: str = ""  # its PEM private key
    ca_file: str = ""  # PEM CA bundle peers must be signed by ("" = no client certificates asked for)
    admin_key: str = field(default="", repr=False)  # required on Admin calls; "" = Admin is open
    api_key: str = field(default="", repr=False)  # required on the router's Generation and HTTP API
    fleet_key: bytes = field(default=b"", repr=False)  # --fleet-key-file's key; b"" = the default file's

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.ca_file and not self.cert_file:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key (mutual TLS: both sides present one)")
        for flag, path in (("--tls-cert", self.cert_file), ("--tls-key", self.key_file), ("--tls-ca", self.ca_file)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag}: no such file {path!r}")

    @property
    def tls(self) -> bool:
        return bool(self.cert_file)

    @property
    def mutual(self) -> bool:
        return bool(self.ca_file)

    def fleet(self) -> bytes:
        """The fleet key: --fleet-key-file's, else the default file's (made on first use)."""
        return self.fleet_key or default_fleet_key()

    def pem(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, private key, CA bundle or None), read now."""
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        return Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes(), ca

    def client_certs(self, policy: str = "required") -> ssl.VerifyMode:
        """What a server asks of its clients: `policy` (a key of CLIENT_CERT_REQS) under mutual TLS;
        without a CA, no certificate (there is none to check it against)."""
        return CLIENT_CERT_REQS[policy] if self.mutual else ssl.CERT_NONE

    def server_context(self, policy: str = "required") -> ssl.SSLContext | None:
        """For HTTP servers (the router's front, /metrics): None without TLS. `policy`: as client_certs."""
        if not self.tls:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.verify_mode = self.client_certs(policy)
        if ctx.verify_mode != ssl.CERT_NONE:
            ctx.load_verify_locations(self.ca_file)
        return ctx

    def client_context(self) -> ssl.SSLContext | None:
        """For HTTPS clients of kvbridge (benchmarks, tests): None without TLS."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.ca_file or None)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def as_dict(self) -> dict:
        """What a rank process needs (it rebuilds the Security): no keys, ranks serve no Admin."""
        return {"cert_file": self.cert_file, "key_file": self.key_file, "ca_file": self.ca_file}


def read_key(path: str, flag: str) -> str:
    """A key file's one line (surrounding whitespace dropped); ValueError naming the flag."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror or e}") from None
    key = raw.strip()
    if not key or len(key) > MAX_KEY_BYTES or not all(0x21 <= b < 0x7F for b in key):
        raise ValueError(f"{flag}: {path!r} must hold one key of 1..{MAX_KEY_BYTES} printable ASCII characters")
    return key.decode()


def read_fleet_key(path: str, flag: str = "--fleet-key-file") -> bytes:
    """A fleet key file's key (read_key's rules, and at least MIN_FLEET_KEY_CHARS characters)."""
    key = read_key(path, flag)
    if len(key) < MIN_FLEET_KEY_CHARS:
        raise ValueError(
            f"{flag}: {path!r} holds {len(key)} characters; a fleet key has at least {MIN_FLEET_KEY_CHARS}"
            " (e.g. `openssl rand -hex 32`)"
        )
    return key.encode()


def default_fleet_key() -> bytes:
    """The key in $KVBRIDGE_CACHE/fleet.key, which the first process of the user to need it makes
    (mode 0600): every process of one user on one host agrees on it with no configuration, and
    other users cannot read it (the trust boundary of the shm pool segments). ValueError naming
    the file when it cannot be made or read, or when other users may read it."""
    return _fleet_key_at(cache_dir() / FLEET_KEY_FILE)


@functools.cache
def _fleet_key_at(path: Path) -> bytes:
    try:
        if not path.exists():
            _create_key_file(path)
        st = path.stat()
    except OSError as e:
        raise ValueError(
            f"the default fleet key {str(path)!r} cannot be made: {e.strerror or e} (or give --fleet-key-file)"
        ) from None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(
            f"the default fleet key {str(path)!r} must belong to this user with mode 0600, "
            f"not uid {st.st_uid} mode {st.st_mode & 0o777:o}"
        )
    return read_fleet_key(str(path), "the default fleet key")


def _create_key_file(path: Path) -> None:
    """Write a fresh key beside `path`, then link it there: readers see no file or the whole key,
    and of two processes racing, the second's link fails and both read the first's."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        with contextlib.suppress(FileExistsError):  # another process made it first: its key is the one
            os.link(tmp, path)
    finally:
        tmp.unlink()


def message_proof(key: bytes, msg, nonce: bytes = b"") -> bytes:
    """HMAC-SHA256 under the fleet key of protobuf message `msg` without its `proof` field (its
    deterministic serialization: fields in number order, as both sides' stubs write them), after
    the message's type name (a proof of one kind never passes for another) and `nonce` (a peer's
    challenge), each ended by a NUL."""
    unsigned = type(msg)()
    unsigned.CopyFrom(msg)
    unsigned.ClearField("proof")
    head = f"{msg.DESCRIPTOR.full_name}\0{nonce.hex()}\0".encode()
    return hmac.new(key, head + unsigned.SerializeToString(deterministic=True), hashlib.sha256).digest()


def message_proof_ok(key: bytes, msg, nonce: bytes = b"") -> bool:
    """`msg.proof` is message_proof's (compared in constant time)."""
    return hmac.compare_digest(msg.proof, message_proof(key, msg, nonce))


def bearer(metadata, key: str) -> str:
    """ "" when `metadata` ((name, value) pairs) carries `authorization: Bearer <key>`, else the
    gRPC status name to refuse with: UNAUTHENTICATED (no bearer) or PERMISSION_DENIED (another)."""
    given = next((v for k, v in metadata or () if k == "authorization"), None)
    return check_bearer(given if isinstance(given, str) else None, key)


def check_bearer(header: str | None, key: str) -> str:
    """The same for an `Authorization` header's value (None when absent)."""
    if not header or not header.startswith("Bearer "):
        return "UNAUTHENTICATED"
    return "" if hmac.compare_digest(header[7:].strip().encode(), key.encode()) else "PERMISSION_DENIED"


def auth_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """The metadata a call carries to pass a server's key check (none for an empty key)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


def add_tls_flags(parser: argparse.ArgumentParser, admin_key: bool = True, fleet_key: bool = True) -> None:
    group = parser.add_argument_group("security (SECURITY.md)")
    group.add_argument("--tls-cert", default="", metavar="FILE", help="PEM certificate: TLS on every port")
    group.add_argument("--tls-key", default="", metavar="FILE", help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-ca", default="", metavar="FILE", help="PEM CA: mutual TLS, peers must present a certificate it signed"
    )
    if admin_key:
        group.add_argument(
            "--admin-key-file", default="", metavar="FILE", help="Admin calls need this key (Bearer); off when absent"
        )
    if fleet_key:
        group.add_argument(
            "--fleet-key-file", default="", metavar="FILE",
            help=f"the fleet's shared key (one line, >= {MIN_FLEET_KEY_CHARS} characters): give every process of a "
            f"fleet across hosts the same file (default: $KVBRIDGE_CACHE/{FLEET_KEY_FILE}, made on first use)",
        )  # fmt: skip


def from_flags(args: argparse.Namespace, api_key_file: str = "") -> Security:
    """The process's Security from add_tls_flags' flags; ValueError naming the bad flag."""
    admin_file, fleet_file = getattr(args, "admin_key_file", ""), getattr(args, "fleet_key_file", "")
    return Security(
        cert_file=args.tls_cert,
        key_file=args.tls_key,
        ca_file=args.tls_ca,
        admin_key=read_key(admin_file, "--admin-key-file") if admin_file else "",
        api_key=read_key(api_key_file, "--api-key-file") if api_key_file else "",
        fleet_key=read_fleet_key(fleet_file) if fleet_file else b"",
    )
