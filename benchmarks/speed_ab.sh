#!/usr/bin/env bash
# Offline A/B between two commits: `dflash-trt bench speed` with the same arguments on REV ("base", from a git
# worktree: ab_worktree.sh) and on this working tree ("new"), alternating round by round so both see the same drift
# of a noisy machine; each run's speedup is measured against its own plain decoding. Session 33's AVX2 kernel
# figures (benchmarks/README.md, "A real AVX2 CPU") are these runs. A benchmark, never part of `make test`.
#
#   benchmarks/speed_ab.sh REV [bench speed options]   # ROUNDS=2 NAME=speed_ab
#   ROUNDS=2 NAME=speed_cpu_small_s33_avx2_kernels benchmarks/speed_ab.sh a63ff9a --dataset cpu-small -k 7 \
#       --tree-nodes 3 --lookup-nodes 7 --max-tokens 64 --threads 2 --rounds 1
set -euo pipefail
REV=${1:?usage: benchmarks/speed_ab.sh REV [bench speed options]}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${ROUNDS:-2}
NAME=${NAME:-speed_ab}
source "$ROOT/benchmarks/ab_worktree.sh"
for r in $(seq 1 "$ROUNDS"); do
  for side in base new; do
    out="$ROOT/benchmarks/results/${NAME}_${side}_r$r.json"
    if [[ $side == base ]]; then
      (cd "$WORK/old" && PYTHONPATH="$OLD_PYTHONPATH" "$ROOT/.venv/bin/python" -m dflash_trt.cli bench speed "$@" \
        -o "$out" >/dev/null)
    else
      (cd "$ROOT" && "$ROOT/.venv/bin/python" -m dflash_trt.cli bench speed "$@" -o "$out" >/dev/null)
    fi
    "$ROOT/.venv/bin/python" - "$out" "$side" "$r" <<'PY'
import json, sys
overall = json.load(open(sys.argv[1]))["overall"]
print(f"{sys.argv[2]} round {sys.argv[3]}: plain {overall['ar']['tok_s']} tok/s; " + "; ".join(
    f"{name} {o['tok_s']} tok/s, tau {o['tau']}, {o['speedup']}x, {o['identical_outputs']} identical"
    for name, o in overall.items() if name != "ar"))
PY
  done
done
