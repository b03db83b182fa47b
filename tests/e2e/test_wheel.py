"""The built wheel, installed into a fresh virtual environment that already holds packages named
`common` and `engine` (as any project may): it adds one top-level name, `kvbridge`; both of theirs
still import as they were; and the installed `kvbridge serve` serves the same tokens as this checkout.

The fresh environment reaches the heavy dependencies (torch, grpcio, ...) through a path file
pointing at this checkout's environment, so the test installs only the wheel (--no-deps)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

from kvbridge.common.sampling import SamplingParams
from tests.conftest import make_llm, make_prompts

ROOT = pathlib.Path(__file__).resolve().parents[2]
THEIRS = {"common": "their common", "engine": "their engine"}  # the packages the environment already holds

CLIENT = """
import sys
import common, engine
from kvbridge.common import rpc
from kvbridge.v1 import common_pb2, generation_pb2, generation_pb2_grpc
print(common.MARK, "|", engine.MARK, "|", rpc.__file__)
stub = generation_pb2_grpc.GenerationStub(rpc.make_channel(sys.argv[1]))
ids = [int(x) for x in sys.argv[2].split(",")]
req = generation_pb2.GenerateRequest(
    prompt=common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=ids)),
    sampling=common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True),
)
print(",".join(str(t) for r in stub.Generate(req, timeout=120) for t in r.token_ids))
"""


def run(*cmd, **kw) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert done.returncode == 0, f"{cmd}: {done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_the_wheel_installs_beside_packages_named_common_and_engine_and_serves(tmp_path, tiny_model):
    src = tmp_path / "src"  # (setuptools builds in the source tree: a copy, so the checkout stays as it is)
    shutil.copytree(
        ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "tests")
    )
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src)
    [wheel] = (tmp_path / "dist").glob("kvbridge-*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"kvbridge", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "kvbridge/engine/kernels/decoder_bf16.cpp" in zipfile.ZipFile(wheel).namelist()

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    site = pathlib.Path(
        run(venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip()
    )
    for name, mark in THEIRS.items():
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"MARK = {mark!r}\n")
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")  # torch, grpcio, ... of this environment
    run(venv / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel)

    serve = subprocess.Popen(
        [venv / "bin/kvbridge", "serve", "--model", "tiny-random", "--dtype", "float32", "--page-size", "4",
         "--port", "0", "--host", "127.0.0.1", "--quiet"],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        while not (line := serve.stderr.readline()).startswith("kvbridge serve: listening on "):
            assert line, "the installed node exited before it was ready"
        addr = line.split("listening on ")[1].strip()
        prompt = make_prompts(1, tiny_model.config.vocab_size, seed=5)[0]
        out = run(venv / "bin/python", "-c", CLIENT, addr, ",".join(map(str, prompt)), cwd=tmp_path).splitlines()
    finally:
        serve.terminate()
        serve.wait(60)
    theirs, mine, rpc_file = (s.strip() for s in out[0].split("|"))
    assert (theirs, mine) == (THEIRS["common"], THEIRS["engine"])
    assert rpc_file == str(site / "kvbridge" / "common" / "rpc.py")  # the wheel's, not this checkout's
    want = make_llm(tiny_model).generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert [int(t) for t in out[1].split(",")] == want.output_ids
