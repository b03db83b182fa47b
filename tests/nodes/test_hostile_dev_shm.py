"""What any local user can plant in /dev/shm before a node starts: a name where the rank registry
goes (a regular file, a symlink, another user's directory), entries in it that are no pid
(`99999999999999999999`: OverflowError in os.kill; `²`: str.isdigit() but not int()), segment
names of the same kind (`kvbridge-²-x`). A node still starts, serves and stops cleanly; a refused
registry is warned about once, and the rank computes as if alone (pipeline/cores.py).

Each case runs in a child process under `unshare --mount --propagation private` that mounts a
fresh tmpfs on /dev/shm first, so that nothing planted reaches the host's real /dev/shm (nor the
nodes running on it). The child is this file run as a module (`python -m tests.nodes.test_hostile_dev_shm
CASE`): it plants the case, starts the nodes in-process, sends a request, stops them, and prints
what it saw as one JSON line.

A front whose rank fails or dies while starting exits 1 and says why (`kvbridge serve|decode`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KVBRIDGE = str(Path(sys.executable).parent / "kvbridge")
UNSHARE = shutil.which("unshare")
CHILD_TIMEOUT_S = 240  # (a child starts torch and a node or two on a loaded 2-core host)
NOT_PIDS = ("99999999999999999999", "²", "-1", "0", "007", "4194304", "٣", "12 ")
SEGMENTS = ("kvbridge-²-x", "kvbridge-99999999999999999999-x", "kvbridge--1-x", "kvbridge-0-x")
TOKENS = 6  # generated per request
REFUSED = "event=rank_registry_refused"


def in_private_shm(*argv: str, shm_size: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    """`argv` in a mount namespace of its own with a fresh tmpfs on /dev/shm (of shm_size, if given).
    Skips, naming the error, where no namespace can be made (not root, no unshare)."""
    if UNSHARE is None:
        pytest.skip("needs unshare (util-linux)")
    probe = subprocess.run([UNSHARE, "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace: `unshare --mount` failed: {probe.stderr.strip()}")
    options = f"-o size={shm_size} " if shm_size else ""
    script = f'mount -t tmpfs {options}kvbridge-test /dev/shm && exec "$@"'
    cmd = [UNSHARE, "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env={**os.environ, **(env or {})}
    )


def run_case(case: str) -> tuple[dict, str]:
    """The child's JSON report and its stderr."""
    child = in_private_shm(sys.executable, "-m", "tests.nodes.test_hostile_dev_shm", case)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1]), child.stderr


@pytest.mark.parametrize("case", ["file", "symlink", "foreign"])
def test_a_registry_path_planted_by_another_user_is_refused_once_and_the_node_serves(case):
    report, stderr = run_case(case)
    assert report["tokens"] == TOKENS and report["rank_exits"] == [0]
    assert report["registry"] == report["planted"]  # left as it was: nothing registered in it
    assert stderr.count(REFUSED) == 1, stderr[-4000:]  # the node's one rank, once


def test_entries_and_segments_that_are_no_pid_are_ignored_by_a_prefill_and_a_decode_node():
    report, stderr = run_case("entries")
    assert report["tokens"] == TOKENS and report["rank_exits"] == [0, 0]
    assert report["registered"] == 2  # both nodes' ranks, while they ran
    assert report["registry"] == sorted(NOT_PIDS)  # after: the ranks left; the rest untouched
    assert report["segments"] == sorted(SEGMENTS)
    assert REFUSED not in stderr


def test_a_front_whose_rank_fails_to_start_exits_non_zero():
    # (the front resolves no device; the rank does, and finds no CUDA)
    node = subprocess.run(
        [KVBRIDGE, "serve", "--model", "tiny-random", "--port", "0", "--device", "cuda", "--quiet"],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert node.returncode == 1, node.stderr[-4000:]
    error = "kvbridge serve: error: pipeline rank 0 failed to start: ValueError: device 'cuda' asked for, but CUDA"
    assert error in node.stderr


def test_a_front_whose_rank_dies_while_starting_exits_non_zero():
    # a /dev/shm too small for the decode rank's pool: the rank takes SIGBUS filling its segment
    cmd = (KVBRIDGE, "decode", "--model", "tiny-random", "--port", "0", "--transfer-backend", "shm", "--quiet")
    node = in_private_shm(*cmd, shm_size="256k", env={"CUDA_VISIBLE_DEVICES": ""})
    assert node.returncode == 1, node.stderr[-4000:]
    assert "kvbridge decode: error: pipeline rank 0 exited with status -7 while the node started" in node.stderr


# ---------------------------------------------------------------- the child, in its namespace


def _plant(case: str, registry: Path) -> None:
    elsewhere = Path("/dev/shm/elsewhere")
    if case == "file":
        registry.write_text("not a directory")
    elif case == "symlink":
        elsewhere.mkdir(mode=0o700)
        (elsewhere / str(os.getpid())).touch()  # a live process's entry: not to be counted
        registry.symlink_to(elsewhere)
    elif case == "foreign":
        registry.mkdir(mode=0o700)
        (registry / str(os.getpid())).touch()
        os.chown(registry, 65534, 65534)
    else:
        registry.mkdir(mode=0o700)
        for name in NOT_PIDS:
            (registry / name).touch()
        for name in SEGMENTS:
            Path("/dev/shm", name).write_bytes(b"\0" * 64)


def _contents(path: Path) -> object:
    """What is at `path`: a file's text, a symlink's target and its listing, a directory's listing."""
    if path.is_symlink():
        return [os.readlink(path), sorted(os.listdir(path))]
    return sorted(os.listdir(path)) if path.is_dir() else path.read_text()


def _child(case: str) -> dict:
    from kvbridge.common import logs, rpc
    from kvbridge.engine.config import PPConfig
    from kvbridge.nodes import start_node
    from kvbridge.pipeline import cores
    from kvbridge.serving.config import NodeConfig
    from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
    from tests.pd import TINY, pd_generate, start_nodes, stop_nodes, token_prompt

    logs.setup("warning")  # (the ranks log at the front's level)
    registry = cores.directory()
    assert registry.parent == Path("/dev/shm"), registry
    _plant(case, registry)
    planted = _contents(registry)
    sampling = common_pb2.SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)
    if case == "entries":
        nodes = start_nodes({"p": ("prefill", 1), "d": ("decode", 1, "shm")})
        try:
            registered = len(set(registry.iterdir()) - {registry / n for n in NOT_PIDS})
            tokens = pd_generate(nodes["p"].address, nodes["d"].address, token_prompt([5, 6, 7]), TOKENS)[0]
        finally:
            stop_nodes(nodes)
        procs = [p for n in nodes.values() for p in n.node.ranks.procs]
        segments = sorted(p.name for p in Path("/dev/shm").glob("kvbridge-*") if p != registry)
        return {"tokens": len(tokens), "rank_exits": [p.exitcode for p in procs], "registered": registered,
                "registry": _contents(registry), "segments": segments}  # fmt: skip
    node = start_node("colocated", NodeConfig(TINY, PPConfig()))
    try:
        req = generation_pb2.GenerateRequest(prompt=token_prompt([5, 6, 7]), sampling=sampling)
        stream = generation_pb2_grpc.GenerationStub(rpc.make_channel(node.address)).Generate(req, timeout=120)
        tokens = [t for r in stream for t in r.token_ids]
    finally:
        node.stop()
    procs = node.node.ranks.procs
    return {"tokens": len(tokens), "rank_exits": [p.exitcode for p in procs], "planted": planted,
            "registry": _contents(registry)}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])), flush=True)
