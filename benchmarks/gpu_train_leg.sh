#!/usr/bin/env bash
# One GPU training leg for the SmolLM2 drafter (issue 3), run through the device tool's `run` on a lent GPU: an H100
# (80 GB, the default kind; the two runs need far less) unless the call names nvidia-h200. 15 minutes of device time
# in all, the machine's start included; a command at most 600 s; no network there.
#
# The target is converted once from the GGUF parts, then two recipes train side by side on the one GPU: the shipped
# drafter continued at its depth, and grown one layer deeper. Both start from drafters/smollm2-135m-dflash and train on
# the CPU runs' records (.stage/responses.jsonl.gz). Results come back in $OUT as res.tar.partNN.
#
# A device call carries at most 64 MiB with the working tree (55 MB tracked), so the leg takes two calls. Both send
# the same tree: the second must start within the machine's 30 s idle window (a git command between them can overrun
# it, and the machine goes back with the GGUF's first part), so what call 1 has no room for stays out of the tree for
# both, and call 2 carries the one file it needs:
#   1. .venv/bin/python benchmarks/stage_gpu_training.py --first-part-mb 60
#   2. git rm -r -q --cached drafters/smollm2-135m-dflash/model.safetensors drafters/smollm2-135m-dflash/training-data
#      benchmarks/results, and the same three paths in .git/info/exclude
#   3. call 1, carry .stage/a, timeout_s 300:  CALL=1 OUT=$OUT bash benchmarks/gpu_train_leg.sh
#      keeps the GGUF's first part in /root/stage and smokes the CUDA path on a tiny target ($OUT/smoke.log); a smoke
#      that decodes leaves /root/smoke_ok, else call 2 picks its drafters by held-out loss (--eval-prompts 0); then
#      times a training step of SmolLM2's shape ($OUT/profile.log, benchmarks/profile_train_step.py: never measured
#      on a GPU since session 35's leg lost its steps to cuDNN attention plans)
#   4. call 2 at once, carry .stage/b .stage/tok .stage/whl .stage/responses.jsonl.gz
#      drafters/smollm2-135m-dflash/model.safetensors (and .stage/prompts.jsonl.gz with GEN_SECONDS), timeout_s 600:
#      DEADLINE=540 OUT=$OUT bash benchmarks/gpu_train_leg.sh
#      (DEADLINE=budget_left_s - 60 where call 1's reply leaves less than 600 s in lease.budget_left_s: the tar
#      comes last, and what is not under $OUT when the lease ends is lost)
#   5. give_back; git reset -q -- the three paths; empty .git/info/exclude. Commit nothing between 2 and 5.
#
# After the leg, on the CPU, in one session (held-out tau in the run's log is a selection figure, not a result):
#   cat res.tar.part* | tar -x -C /tmp/leg   (lN/drafter; lN.log; NOT_FINISHED_NORMALLY where a run was cut short)
#   .venv/bin/python benchmarks/bench_drafter.py --drafter D --prompts 13 --ks 3,7 --name NAME (a NAME per drafter:
#     results/NAME.json) for the shipped drafter and each lN/drafter: held-out 0-12, the longest prefix of its 16
#     disjoint from the 12 the run chose on (held-out greedy records, each source in turn; held-out 13 among them)
#   .venv/bin/python benchmarks/diagnose_acceptance.py --drafter D: the per-slot picture only, never a reason to ship
#   ship only on bench_drafter's figures and `dflash-trt bench speed engines/... --dataset cpu-small` (issue 8's 2x
#   at one stream is measured so): the candidate's engine built from a copy of build_configs/smollm2-135m-cpu.yaml
#   with speculative_model set to it, against engines/smollm2-135m-cpu, same flags, same session.
#
#   CALL=1 bash benchmarks/gpu_train_leg.sh, then DEADLINE=540 [GEN_SECONDS=90] bash benchmarks/gpu_train_leg.sh
# DEADLINE: seconds the whole leg may take; GEN_SECONDS: first grow the data for that long (sampled answers to the
# packaged prompts, benchmarks/gpu_train_drafter.py --gen-only), the grown records coming back with the results.
set -uo pipefail
: "${OUT:?set OUT (the output folder of the device call)}"
DEADLINE=${DEADLINE:-540}
GEN_SECONDS=${GEN_SECONDS:-0}
S=.stage
start=$(date +%s)
export PYTHONUNBUFFERED=1 DFLASH_TRT_CPU_KERNELS=0 TQDM_MININTERVAL=30
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "${CALL:-2}" = 1 ]; then
  mkdir -p /root/stage && cp $S/a/gguf.zst.0 /root/stage/ || exit 1
  rm -rf /root/smoke_ok /root/smoke /root/ws  # a stale log must not pass for this smoke
  # tau needs the engine on CUDA; a smoke that never logged one leaves call 2 choosing by held-out loss
  timeout -k 10 120 python3 benchmarks/gpu_train_drafter.py --smoke --gen-seconds 10 --train-seconds 30 \
    --eval-every 20 --eval-prompts 2 --out /root/smoke --work /root/ws > "$OUT/smoke.log" 2>&1 \
    && grep -q val_tau /root/smoke/train_log.jsonl && touch /root/smoke_ok
  grep -E "^(torch|generated|[0-9]+ records|before training|trained|step |best|Traceback)|Error" "$OUT/smoke.log"
  echo "smoke $([ -f /root/smoke_ok ] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s"
  timeout -k 5 100 python3 benchmarks/profile_train_step.py --device cuda --steps 2 --profile-steps 1 \
    > "$OUT/profile.log" 2>&1
  tail -25 "$OUT/profile.log"
  echo "call 1 done in $(( $(date +%s) - start )) s"
  exit 0
fi
# a fresh machine (call 1's went back idle) holds no first part: say so before pip and the target's build
[ -f /root/stage/gguf.zst.0 ] \
  || { echo "no /root/stage/gguf.zst.0: this machine did not run call 1; rerun it"; exit 1; }
# a rerun on the same machine starts clean: stale records, or a cut-short run's old drafter taken for this one's
rm -rf /root/res /root/w2 /root/w3 /root/gen /root/wgen
[ -f drafters/smollm2-135m-dflash/model.safetensors ] \
  || { echo "carry drafters/smollm2-135m-dflash/model.safetensors"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $S/whl/*.whl \
  && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
mkdir -p /root/res
python3 benchmarks/gpu_train_drafter.py --prepare-only --gguf-parts /root/stage/gguf.zst.0,$S/b/gguf.zst.1 \
  --tokenizer $S/tok --target-dir /root/target --out /root/res/prep --work /root/prep 2>&1 | tail -4
[ -f /root/target/config.json ] || { echo "target build failed"; exit 1; }
records=$S/responses.jsonl.gz
if [ "$GEN_SECONDS" != 0 ]; then  # sampled answers to the packaged prompts first, through BatchGenerator
  python3 benchmarks/gpu_train_drafter.py --target-dir /root/target --records "$records" --prompts $S/prompts.jsonl.gz \
    --gen-seconds "$GEN_SECONDS" --gen-only --out /root/gen --work /root/wgen 2>&1 \
    | grep -E "^(generated|[0-9]+ records)|Error"
  [ -f /root/gen/responses.jsonl.gz ] && records=/root/gen/responses.jsonl.gz
fi
left=$(( DEADLINE - ($(date +%s) - start) - 15 ))
eval_prompts=12
[ -f /root/smoke_ok ] || { eval_prompts=0; echo "no /root/smoke_ok from call 1: choosing by held-out loss"; }
echo "target built and data ready at $(( $(date +%s) - start )) s; $left s for training"
# under 2 minutes the runs would spend it loading and evaluating (and timeout 0 means no limit): none, the grown
# data kept
if [ "$left" -lt 120 ]; then
  echo "only $left s left of DEADLINE=$DEADLINE: no training"
  [ -f /root/gen/responses.jsonl.gz ] && cp /root/gen/responses.jsonl.gz "$OUT/"
  exit 1
fi
common=(--target-dir /root/target --records "$records" --init-drafter drafters/smollm2-135m-dflash
        --deadline-s "$left" --eval-every 300 --eval-prompts "$eval_prompts")
# -k: a run stuck past SIGTERM (its step in flight, a checkpoint) must not hold the tar back past the call's 600 s
timeout -k 10 $(( left + 20 )) python3 benchmarks/gpu_train_drafter.py "${common[@]}" --layers 2 --lr 3e-4 --seed 40 \
  --out /root/res/l2 --work /root/w2 > /root/res/l2.log 2>&1 &
p2=$!
timeout -k 10 $(( left + 20 )) python3 benchmarks/gpu_train_drafter.py "${common[@]}" --layers 3 --lr 5e-4 --seed 41 \
  --out /root/res/l3 --work /root/w3 > /root/res/l3.log 2>&1 &
p3=$!
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 90 &
smi=$!
wait "$p2" "$p3"
kill $smi 2>/dev/null
for run in l2 l3; do
  echo "== $run"
  grep -E "^(torch|target|[0-9]+ records|before training|trained|step |best|Traceback)|Error" /root/res/$run.log \
    | tail -30
  # A run cut short (timeout, an evaluation's error, TrainingDiverged) still leaves its last best export in its work
  # folder (drafter.old: killed between an export's two renames)
  w=/root/w${run#l}/out
  if [ ! -d /root/res/$run/drafter ]; then
    for d in drafter drafter.old; do
      [ -d "$w/$d" ] || continue
      mkdir -p /root/res/$run && cp -r "$w/$d" /root/res/$run/drafter
      cp "$w/train_log.jsonl" /root/res/$run/ 2>/dev/null
      echo "$run: not finished normally; drafter copied from $w/$d (training.json: its step)" \
        | tee /root/res/$run/NOT_FINISHED_NORMALLY
      break
    done
  fi
done
rm -rf /root/res/prep
[ -f /root/gen/responses.jsonl.gz ] && cp /root/gen/responses.jsonl.gz /root/res/
tar -C /root/res -cf - . | split -b 15M -d - "$OUT/res.tar.part"
ls -la "$OUT"
echo "leg done in $(( $(date +%s) - start )) s"
