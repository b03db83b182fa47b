"""Walk one streamed chat through a fleet and count the project's files that run code for it.

    .venv/bin/python scripts/walk.py [--checkout DIR] [--model M]

Starts a prefill and a decode node (pp 2 each, shm) and a router as CLI processes, from DIR (this
checkout by default; another checkout of kvbridge, e.g. an older commit, is run with this
environment's python and DIR first on the path). Every process, rank processes included, loads a
profiler (a sitecustomize on PYTHONPATH) that notes each Python function called, by file, from
SIGUSR1 to SIGUSR2. After a warm-up chat, the walk signals every process, streams one chat through
the router's HTTP port, signals again, and prints one JSON line: the files (relative to DIR) that ran
code for the request, in which processes, and how many times a tokenizer encoded text.

Not part of the product: a measurement for docs/architecture.md ("One streamed chat").
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

PROFILER = r"""
import os, signal, sys, threading, json, collections
_root, _out = os.environ["WALK_ROOT"], os.environ["WALK_OUT"]
_on = False
_calls = collections.Counter()
_encodes = collections.Counter()  # the tokenizers library's encode calls (Rust: seen as c_call)

def _profile(frame, event, arg):
    if not _on:
        return
    if event == "call":
        f = frame.f_code.co_filename
        if f.startswith(_root):
            _calls[(f, frame.f_code.co_name)] += 1
    elif event == "c_call" and getattr(arg, "__name__", "") in ("encode", "encode_batch", "encode_batch_fast"):
        if type(getattr(arg, "__self__", None)).__module__.startswith("tokenizers"):
            _encodes[arg.__name__] += 1

def _start(*_):
    global _on
    _calls.clear()
    _encodes.clear()
    _on = True

def _stop(*_):
    global _on
    _on = False
    rows = [[f, n, c] for (f, n), c in _calls.items()]
    with open(os.path.join(_out, f"{os.getpid()}.json"), "w") as fh:
        json.dump({"argv": sys.argv, "calls": rows, "encodes": dict(_encodes)}, fh)

sys.setprofile(_profile)
threading.setprofile(_profile)
signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _stop)
"""

PRODUCT = {
    "common",
    "engine",
    "consensus",
    "kv_transfer",
    "pipeline",
    "serving",
    "prefill_node",
    "decode_node",
    "router",
    "kvbridge",
}
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12, "stream": True}


def ready_line(proc: subprocess.Popen, prefix: str) -> str:
    while not (line := proc.stderr.readline()).startswith(prefix):
        if not line:
            raise SystemExit(f"walk: a process exited before it was ready ({prefix})")
    return line.strip()


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    pids = [int(p) for p in out]
    return pids + [c for p in pids for c in children(p)]


def chat(http: str) -> str:
    req = urllib.request.Request(
        f"http://{http}/v1/chat/completions", json.dumps(CHAT).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.read().decode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", default=str(pathlib.Path(__file__).resolve().parents[1]))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    root = pathlib.Path(args.checkout).resolve()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="walk-"))
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(PROFILER)
    env = {**os.environ, "WALK_ROOT": str(root), "WALK_OUT": str(tmp), "PYTHONPATH": f"{tmp / 'site'}:{root}"}
    cmd = [sys.executable, "-m", "kvbridge"]
    node = ["--model", args.model, "--pp-size", "2", "--port", "0", "--quiet"]
    procs = []

    def start(*argv, ready):
        p = subprocess.Popen([*cmd, *argv], env=env, cwd=root, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        print(f"walk: starting {argv[0]} ...", file=sys.stderr, flush=True)
        return ready_line(p, ready)

    try:
        p_addr = start("prefill", *node, ready="kvbridge prefill: listening on ").split("listening on ")[1].split()[0]
        d_addr = start("decode", *node, "--transfer-backend", "shm", ready="kvbridge decode: listening on ")
        d_addr = d_addr.split("listening on ")[1].split()[0]
        line = start("router", "--prefill", p_addr, "--decode", d_addr, "--port", "0", "--http-port", "0",
                     ready="kvbridge router: grpc on ")  # fmt: skip
        http = line.split("http on ")[1].split(",")[0].strip()
        chat(http)  # warm-up: first-use paths (compiles, caches) are not the request's way
        time.sleep(1)
        pids = [p.pid for p in procs] + [c for p in procs for c in children(p.pid)]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
        body = chat(http)
        time.sleep(1)
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        time.sleep(2)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    files: dict[str, set[str]] = {}
    encodes, touched = 0, 0
    for dump in tmp.glob("*.json"):
        data = json.loads(dump.read_text())
        encodes += sum(data["encodes"].values())
        mine = set()
        for f, _name, _count in data["calls"]:
            rel = str(pathlib.Path(f).relative_to(root))
            if rel.split("/")[0] not in PRODUCT or rel.startswith("kvbridge/v1/"):
                continue  # not hand-written product code (the environment, generated stubs, tests)
            mine.add(rel)
            files.setdefault(rel, set()).add(dump.stem)
        touched += bool(mine)  # (a resource tracker runs none of it)
    print(
        json.dumps(
            {
                "checkout": str(root),
                "processes": touched,  # that ran the project's code for the request
                "files": len(files),
                "tokenizations": encodes,  # encode calls into the tokenizers library, all processes
                "streamed_bytes": len(body),
                "by_file": {f: len(p) for f, p in sorted(files.items())},
            }
        )
    )


if __name__ == "__main__":
    main()
