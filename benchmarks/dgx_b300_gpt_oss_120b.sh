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
# Two layouts, as NVIDIA's B200 recipes for gpt-oss-120b split them (examples/configs/database/openai/gpt-oss-120b/
# B200: 1k1k_tp8_conc384.yaml shards attention TP8, 1k1k_tp8_conc1024.yaml turns on attention data parallelism):
# concurrencies up to SPLIT run engines from LOW_CONFIG (TP8, max_batch_size SPLIT), those above it engines from
# HIGH_CONFIG (attention DP). Each arm's points of both layouts are joined into one result (each point names its
# layout), so its frontier is the best of the two at every concurrency.
# Needs: TensorRT-LLM with DFlash's TRTLLM-gen attention (PR #16914, merged 2026-08-17: 1.3.0rc25 or later;
# 1.3.0rc20 refuses speculative_config.attention_backend; the engines' config.yaml headers say so) from the
# NGC container or NVIDIA's wheel index, with trtllm-serve on PATH, this package
# installed (pip install -e .), the three checkpoints in the HF cache or reachable, 8 GPUs.
#   benchmarks/dgx_b300_gpt_oss_120b.sh                          # all arms, 1k/1k
#   PRESET=gpu-8k1k KS="3 7" CONC=1,4,16,64,256 benchmarks/dgx_b300_gpt_oss_120b.sh
# Before timing: nvidia-smi -pm 1 (and the clock/power settings in the trtllm-bench docs) as your site allows.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOW_CONFIG=${LOW_CONFIG:-$ROOT/build_configs/gpt-oss-120b-8xb300-latency.yaml}
HIGH_CONFIG=${HIGH_CONFIG:-$ROOT/build_configs/gpt-oss-120b-8xb300-throughput.yaml}
SPLIT=${SPLIT:-384}                 # TP8 up to this concurrency, attention DP above it
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
command -v trtllm-serve >/dev/null ||
  { echo "trtllm-serve not on PATH: install TensorRT-LLM (a release with PR #16914)" >&2; exit 1; }

source "$ROOT/benchmarks/server_lifecycle.sh"   # stop, wait_up
# the concurrencies of CONC at or below SPLIT (tp8), above it (adp), in ascending order
split_conc() { tr , '\n' <<<"$CONC" | sort -n | awk -v s="$SPLIT" -v hi="$1" 'hi ? $1 > s : $1 <= s' | paste -sd, -; }
declare -A LAYOUT_CONC=([tp8]=$(split_conc 0) [adp]=$(split_conc 1))

sweep() {  # label, result path, concurrencies
  # --model: the endpoint's own name for it (from /v1/models); reasoning deltas count as generated tokens
  dflash-trt bench sweep --url "http://127.0.0.1:$PORT" --concurrency "$3" --dataset "$PRESET" \
    --tokenizer "$ENGINE0/tokenizer" --gpus 8 --requests-per-concurrency "$REQS" --label "$1" -o "$2"
}

# edit a YAML: file in, file out, python that edits dict `o`
edit_yaml() {
  python3 - "$1" "$2" "$3" <<'PY'
import sys, yaml
o = yaml.safe_load(open(sys.argv[1]))
exec(sys.argv[3])
yaml.safe_dump(o, open(sys.argv[2], "w"), sort_keys=False)
PY
}

build_once() {  # config, engine, build flags: builds unless ENGINE was built from this config with these flags (an
  # earlier run's engine for another preset, concurrency or edited config is rebuilt, not reused); ENGINE.key says which
  local key
  key="$(sha256sum <"$1" | cut -c1-16) ${*:3}"
  if [[ ! -f "$2/manifest.json" || "$(cat "$2.key" 2>/dev/null)" != "$key" ]]; then
    dflash-trt build "$1" -o "$2" "${@:3}" --force
    echo "$key" >"$2.key"
  fi
}

build_layout() {  # layout, config: one fixed-K DFlash engine per K and the config as written (auto schedule), each
  # validated and planned for B300 at MAX_SEQ (the build refuses what does not fit); then the AR and EAGLE-3 configs
  local L=$1 W=$WORK/$1
  mkdir -p "$W"
  # Rows a rank holds: TP8 serves up to SPLIT requests at once; under attention DP each of the 8 ranks a share of
  # the largest concurrency (the recipes size batch and CUDA graphs to the concurrency; an uneven share waits). No
  # more: DFlash's context arena is dense in rows x max_seq_len, and at the shipped throughput config's 512 rows the
  # 8k presets' would not fit beside the KV cache.
  local top=${LAYOUT_CONC[$L]##*,}
  local rows=$([[ $L == tp8 ]] && echo "$SPLIT" || echo $(((top + 7) / 8)))
  edit_yaml "$2" "$W/config.yaml" \
    "o['max_batch_size'] = $rows; o.setdefault('cuda_graph_config', {})['max_batch_size'] = $rows"
  edit_yaml "$W/config.yaml" "$W/fixed_k.yaml" \
    '[o["speculative_config"].pop(key, None) for key in ("draft_len_schedule", "max_concurrency")]'
  # relative paths in the configs (none in the shipped ones) would now be read from $W
  for k in $KS; do
    build_once "$W/fixed_k.yaml" "$W/dflash_k$k" -k "$k" --max-seq-len "$MAX_SEQ"
  done
  build_once "$W/config.yaml" "$W/dflash_auto" --max-seq-len "$MAX_SEQ"
  # AR and EAGLE-3 use the same engine's target, mapping and runtime settings with the speculative section replaced.
  local e0=$W/dflash_k${KS%% *}
  edit_yaml "$e0/trtllm/config.yaml" "$W/ar.yaml" 'o.pop("speculative_config", None)'
  edit_yaml "$e0/trtllm/config.yaml" "$W/eagle3.yaml" 'o["speculative_config"] = {"decoding_type": "Eagle3",
    "speculative_model": "nvidia/gpt-oss-120b-Eagle3", "max_draft_len": 3}  # TRT-LLM tech blog 11'
}

run_layout() {  # layout: every arm swept at the layout's concurrencies, into $OUT/<layout>/<name>.json
  local L=$1 W=$WORK/$1 conc=${LAYOUT_CONC[$1]}
  ENGINE0=$W/dflash_k${KS%% *}
  mkdir -p "$OUT/$L"
  for arm in $ARMS; do
    case $arm in
      ar|eagle3)
        (cd "$ENGINE0" && exec trtllm-serve "$ENGINE0/target" --tokenizer "$ENGINE0/tokenizer" --host 127.0.0.1 \
            --port "$PORT" --config "$W/$arm.yaml") >"$OUT/$L/$arm.log" 2>&1 &
        PID=$!; wait_up "$L/$arm" 1800
        label=$([[ $arm == ar ]] && echo "autoregressive" || echo "EAGLE-3 K=3")
        sweep "$label" "$OUT/$L/$arm.json" "$conc"; stop ;;
      dflash)
        for k in $KS; do
          dflash-trt serve "$W/dflash_k$k" --backend trtllm --host 127.0.0.1 --port "$PORT" \
            >"$OUT/$L/dflash_k$k.log" 2>&1 &
          PID=$!; wait_up "$L/dflash_k$k" 1800
          sweep "DFlash K=$k" "$OUT/$L/dflash_k$k.json" "$conc"; stop
        done ;;
      dflash-auto)
        dflash-trt serve "$W/dflash_auto" --backend trtllm --host 127.0.0.1 --port "$PORT" \
          >"$OUT/$L/dflash_auto.log" 2>&1 &
        PID=$!; wait_up "$L/dflash_auto" 1800
        sweep "DFlash auto" "$OUT/$L/dflash_auto.json" "$conc"; stop ;;
      *) echo "unknown arm $arm" >&2; exit 1 ;;
    esac
  done
}

layouts=()
if [[ -n ${LAYOUT_CONC[tp8]} ]]; then layouts+=(tp8); build_layout tp8 "$LOW_CONFIG"; fi
if [[ -n ${LAYOUT_CONC[adp]} ]]; then layouts+=(adp); build_layout adp "$HIGH_CONFIG"; fi
for L in "${layouts[@]}"; do run_layout "$L"; done

# One result per arm: its points in both layouts, each naming its layout (and the auto engine's schedule there).
names=()
for arm in $ARMS; do
  case $arm in
    dflash) for k in $KS; do names+=("dflash_k$k"); done ;;
    dflash-auto) names+=(dflash_auto) ;;
    *) names+=("$arm") ;;
  esac
done
runs=()
for name in "${names[@]}"; do
  python3 - "$OUT/$name.json" "$WORK" "$name" "${layouts[@]}" <<'PY'
import json, sys
out, work, name, layouts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
joined = None
for layout in layouts:
    run = json.load(open(f"{out.rsplit('/', 1)[0]}/{layout}/{name}.json"))
    schedule = (json.load(open(f"{work}/{layout}/dflash_auto/plan.json"))["draft_len_schedule"]
                if name == "dflash_auto" else None)
    for p in run["points"]:
        p["layout"] = layout if schedule is None else f"{layout}, schedule {schedule}"
    if joined is None:
        joined = {**run, "layouts": {}}
    else:
        joined["points"] += run["points"]
        joined["complete"] = joined.get("complete") is not False and run.get("complete") is not False
    joined["layouts"][layout] = sorted(p["concurrency"] for p in run["points"])
joined["points"].sort(key=lambda p: p["concurrency"])
json.dump(joined, open(out, "w"), indent=2)
PY
  runs+=("$OUT/$name.json")
done
dflash-trt bench plot "${runs[@]}" -o "$OUT/pareto.png" \
  --title "gpt-oss-120b, DGX B300 (TP8/EP8 up to c=$SPLIT, attention DP above), $PRESET"
echo "results in $OUT" >&2
