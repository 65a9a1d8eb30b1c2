#!/usr/bin/env bash
# One GPU training leg for the SmolLM2 drafter (issue 3), run inside one device call on a lent H200.
#
# The target is converted once from the GGUF parts, then two recipes train side by side on the one GPU: the shipped
# drafter continued at its depth, and grown one layer deeper. Both start from drafters/smollm2-135m-dflash and train on
# the CPU runs' records (.stage/responses.jsonl.gz). Results come back in $OUT as res.tar.partNN (cat them, untar).
#
# A device call carries at most 64 MiB with the working tree (48 MB tracked), so the leg takes two calls, the second
# within the machine's 30 s idle window:
#   1. .venv/bin/python benchmarks/stage_gpu_training.py --first-part-mb 60
#   2. leave out of call 1 what it does not need: git rm -r -q --cached drafters/smollm2-135m-dflash/model.safetensors
#      drafters/smollm2-135m-dflash/training-data benchmarks/results, the same paths in .git/info/exclude
#   3. call 1, carry .stage/a:  mkdir -p /root/stage && cp .stage/a/gguf.zst.0 /root/stage/
#   4. git reset -q -- drafters/smollm2-135m-dflash/model.safetensors (and out of .git/info/exclude), then call 2,
#      carry .stage/b .stage/tok .stage/whl .stage/responses.jsonl.gz (and .stage/prompts.jsonl.gz with GEN_SECONDS):
#      DEADLINE=540 OUT=$OUT bash benchmarks/gpu_train_leg.sh
#   5. git reset -q -- drafters/smollm2-135m-dflash/training-data benchmarks/results; empty .git/info/exclude.
# Commit nothing between 2 and 5. Run benchmarks/profile_train_step.py --device cuda first if the step's speed on the
# device is unknown (session 35's leg lost its steps to cuDNN attention plans: benchmarks/README.md).
#
#   DEADLINE=540 [GEN_SECONDS=90] bash benchmarks/gpu_train_leg.sh
# DEADLINE: seconds the whole leg may take; GEN_SECONDS: first grow the data for that long (sampled answers to the
# packaged prompts, benchmarks/gpu_train_drafter.py --gen-only), the grown records coming back with the results.
set -uo pipefail
: "${OUT:?set OUT (the output folder of the device call)}"
DEADLINE=${DEADLINE:-500}
GEN_SECONDS=${GEN_SECONDS:-0}
S=.stage
start=$(date +%s)
export PYTHONUNBUFFERED=1 DFLASH_TRT_CPU_KERNELS=0 TQDM_MININTERVAL=30
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $S/whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
mkdir -p /root/res
python3 benchmarks/gpu_train_drafter.py --prepare-only --gguf-parts /root/stage/gguf.zst.0,$S/b/gguf.zst.1 \
  --tokenizer $S/tok --target-dir /root/target --out /root/res/prep --work /root/prep 2>&1 | tail -4
[ -f /root/target/config.json ] || { echo "target build failed"; exit 1; }
records=$S/responses.jsonl.gz
if [ "$GEN_SECONDS" != 0 ]; then  # sampled answers to the packaged prompts first, through BatchGenerator
  python3 benchmarks/gpu_train_drafter.py --target-dir /root/target --records "$records" --prompts $S/prompts.jsonl.gz \
    --gen-seconds "$GEN_SECONDS" --gen-only --out /root/gen --work /root/wgen 2>&1 | grep -E "^(generated|[0-9]+ records)|Error"
  [ -f /root/gen/responses.jsonl.gz ] && records=/root/gen/responses.jsonl.gz
fi
left=$(( DEADLINE - ($(date +%s) - start) - 30 ))
echo "target built and data ready at $(( $(date +%s) - start )) s; $left s for training"
common=(--target-dir /root/target --records "$records" --init-drafter drafters/smollm2-135m-dflash
        --deadline-s "$left" --eval-every 300 --eval-prompts 12)
timeout $(( left + 20 )) python3 benchmarks/gpu_train_drafter.py "${common[@]}" --layers 2 --lr 3e-4 --seed 40 \
  --out /root/res/l2 --work /root/w2 > /root/res/l2.log 2>&1 &
p2=$!
timeout $(( left + 20 )) python3 benchmarks/gpu_train_drafter.py "${common[@]}" --layers 3 --lr 5e-4 --seed 41 \
  --out /root/res/l3 --work /root/w3 > /root/res/l3.log 2>&1 &
p3=$!
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 90 &
smi=$!
wait "$p2" "$p3"
kill $smi 2>/dev/null
for run in l2 l3; do
  echo "== $run"
  grep -E "^(torch|target|[0-9]+ records|before training|trained|step |best|Traceback)|Error" /root/res/$run.log | tail -30
done
rm -rf /root/res/prep
[ -f /root/gen/responses.jsonl.gz ] && cp /root/gen/responses.jsonl.gz /root/res/
tar -C /root/res -cf - . | split -b 15M -d - "$OUT/res.tar.part"
ls -la "$OUT"
echo "leg done in $(( $(date +%s) - start )) s"
