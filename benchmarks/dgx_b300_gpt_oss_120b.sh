#!/usr/bin/env bash
# The throughput-versus-interactivity sweep of gpt-oss-120b on one DGX B300 (8 x B300, TP8/EP8), as a user runs it:
# autoregressive, EAGLE-3 (nvidia/gpt-oss-120b-Eagle3, K=3) and DFlash (z-lab/gpt-oss-120b-DFlash, K in 3 5 7 9), each
# served by TensorRT-LLM's trtllm-serve from a `dflash-trt build` engine directory, driven by `dflash-trt bench sweep`
# with the same prompts and concurrencies, then one Pareto plot (tokens/s/GPU against tokens/s/user).
# Protocol as in TensorRT-LLM's gpt-oss deployment guide (ISL/OSL 1k/1k by default, concurrency doubling), but with
# real prompts: SPEED-Bench (nvidia/SPEED-Bench) finds that synthetic inputs overestimate throughput.
#
# Arms: "DFlash K=k" are fixed-K engines (the config's draft-length schedule removed); "DFlash auto" is the config as
# written, whose schedule the build chooses per batch size (plan.json). Every engine is built for the preset's
# ISL + OSL (max_seq_len), and prompts are cut to the ISL with the engine's own tokenizer.
# Needs: TensorRT-LLM with DFlash's TRTLLM-gen attention (PR #16914, merged 2026-08-17: 1.3.0rc25 or later;
# 1.3.0rc20 refuses speculative_config.attention_backend; the engines' config.yaml headers say so) from the
# NGC container or NVIDIA's wheel index, with trtllm-serve on PATH, this package
# installed (pip install -e .), the three checkpoints in the HF cache or reachable, 8 GPUs.
#   benchmarks/dgx_b300_gpt_oss_120b.sh                          # all arms, 1k/1k
#   PRESET=gpu-8k1k KS="3 7" CONC=1,4,16,64,256 benchmarks/dgx_b300_gpt_oss_120b.sh
# Before timing: nvidia-smi -pm 1 (and the clock/power settings in the trtllm-bench docs) as your site allows.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CONFIG=${CONFIG:-$ROOT/build_configs/gpt-oss-120b-8xb300-throughput.yaml}
PRESET=${PRESET:-gpu-1k1k}
CONC=${CONC:-1,2,4,8,16,32,64,128,256,512,1024}
KS=${KS:-"3 5 7 9"}
ARMS=${ARMS:-"ar eagle3 dflash dflash-auto"}
REQS=${REQS:-5}                     # requests per point = 5 x concurrency (NVIDIA's guides use --num-prompts 5c)
WORK=${WORK:-$ROOT/engines/dgx_b300}
OUT=${OUT:-$ROOT/benchmarks/results/dgx_b300_gpt_oss_120b_$PRESET}
PORT=${PORT:-8000}
case $PRESET in
  gpu-1k1k) ISL=1024 OSL=1024 ;; gpu-1k8k) ISL=1024 OSL=8192 ;; gpu-8k1k) ISL=8192 OSL=1024 ;;
  *) echo "PRESET must be gpu-1k1k, gpu-1k8k or gpu-8k1k" >&2; exit 1 ;;
esac
MAX_SEQ=$((ISL + OSL + 256))       # + the chat template and the draft block
mkdir -p "$WORK" "$OUT"
command -v trtllm-serve >/dev/null || { echo "trtllm-serve not on PATH: install TensorRT-LLM (a release with PR #16914)" >&2; exit 1; }

source "$ROOT/benchmarks/server_lifecycle.sh"   # stop, wait_up
sweep() {  # label, result name
  # --model: the endpoint's own name for it (from /v1/models); reasoning deltas count as generated tokens
  dflash-trt bench sweep --url "http://127.0.0.1:$PORT" --concurrency "$CONC" --dataset "$PRESET" \
    --tokenizer "$ENGINE0/tokenizer" --gpus 8 --requests-per-concurrency "$REQS" --label "$1" -o "$OUT/$2.json"
}

# One fixed-K DFlash engine per K from the config without its schedule, and the config as written (auto schedule);
# each validated and planned for B300 at MAX_SEQ (the build refuses what does not fit).
python3 - "$CONFIG" "$WORK/fixed_k.yaml" <<'PY'
import sys, yaml
o = yaml.safe_load(open(sys.argv[1]))
for key in ("draft_len_schedule", "max_concurrency"):
    o["speculative_config"].pop(key, None)
yaml.safe_dump(o, open(sys.argv[2], "w"), sort_keys=False)
PY
for k in $KS; do
  [[ -f "$WORK/dflash_k$k/manifest.json" ]] ||
    dflash-trt build "$WORK/fixed_k.yaml" -o "$WORK/dflash_k$k" -k "$k" --max-seq-len "$MAX_SEQ" --force
done
[[ -f "$WORK/dflash_auto/manifest.json" ]] || dflash-trt build "$CONFIG" -o "$WORK/dflash_auto" --max-seq-len "$MAX_SEQ" --force
first_k=${KS%% *}
ENGINE0=$WORK/dflash_k$first_k

# AR and EAGLE-3 use the same engine's target, mapping and runtime settings with the speculative section replaced.
variant() {  # name, python that edits dict `o`
  python3 - "$ENGINE0/trtllm/config.yaml" "$WORK/$1.yaml" "$2" <<'PY'
import sys, yaml
o = yaml.safe_load(open(sys.argv[1]))
exec(sys.argv[3])
yaml.safe_dump(o, open(sys.argv[2], "w"), sort_keys=False)
PY
}
variant ar 'o.pop("speculative_config", None)'
variant eagle3 'o["speculative_config"] = {"decoding_type": "Eagle3", "speculative_model": "nvidia/gpt-oss-120b-Eagle3", "max_draft_len": 3}  # TRT-LLM tech blog 11'

runs=()
for arm in $ARMS; do
  case $arm in
    ar|eagle3)
      (cd "$ENGINE0" && exec trtllm-serve "$ENGINE0/target" --tokenizer "$ENGINE0/tokenizer" --host 127.0.0.1 \
          --port "$PORT" --config "$WORK/$arm.yaml") >"$OUT/$arm.log" 2>&1 &
      PID=$!; wait_up "$arm" 1800
      label=$([[ $arm == ar ]] && echo "autoregressive" || echo "EAGLE-3 K=3")
      sweep "$label" "$arm"; stop; runs+=("$OUT/$arm.json") ;;
    dflash)
      for k in $KS; do
        dflash-trt serve "$WORK/dflash_k$k" --backend trtllm --host 127.0.0.1 --port "$PORT" >"$OUT/dflash_k$k.log" 2>&1 &
        PID=$!; wait_up "dflash_k$k" 1800
        sweep "DFlash K=$k" "dflash_k$k"; stop; runs+=("$OUT/dflash_k$k.json")
      done ;;
    dflash-auto)
      dflash-trt serve "$WORK/dflash_auto" --backend trtllm --host 127.0.0.1 --port "$PORT" >"$OUT/dflash_auto.log" 2>&1 &
      PID=$!; wait_up dflash_auto 1800
      schedule=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["draft_len_schedule"])' "$WORK/dflash_auto/plan.json")
      sweep "DFlash auto $schedule" dflash_auto; stop; runs+=("$OUT/dflash_auto.json") ;;
    *) echo "unknown arm $arm" >&2; exit 1 ;;
  esac
done
dflash-trt bench plot "${runs[@]}" -o "$OUT/pareto.png" --title "gpt-oss-120b, DGX B300 (TP8/EP8), $PRESET"
echo "results in $OUT" >&2
