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
    --client-cert-reqs (router)       under --tls-ca, what the router's client-facing ports (HTTP
                                      API, gRPC Generation) ask of clients: required (as every
                                      fleet port), optional, or none (router/config.py)

Without flags nothing changes: plaintext, no keys (local development). Keys are compared in
constant time and never logged (their fields are left out of repr).
"""

from __future__ import annotations

import argparse
import hmac
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path

MAX_KEY_BYTES = 4096  # a key file is one line
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


def add_tls_flags(parser: argparse.ArgumentParser, admin_key: bool = True) -> None:
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


def from_flags(args: argparse.Namespace, api_key_file: str = "") -> Security:
    """The process's Security from add_tls_flags' flags; ValueError naming the bad flag."""
    admin_file = getattr(args, "admin_key_file", "")
    return Security(
        cert_file=args.tls_cert,
        key_file=args.tls_key,
        ca_file=args.tls_ca,
        admin_key=read_key(admin_file, "--admin-key-file") if admin_file else "",
        api_key=read_key(api_key_file, "--api-key-file") if api_key_file else "",
    )
