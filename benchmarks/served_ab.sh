#!/usr/bin/env bash
# Served A/B between two commits: paired rounds of benchmarks/peers.sh, this working tree ("new") then REV ("old")
# in every round, so both see the same drift of a noisy machine. REV runs from a git worktree (ab_worktree.sh).
# A benchmark, never part of `make test`.
#
#   benchmarks/served_ab.sh REV                       # ROUNDS=3 REQS=24 CONC=1 SYSTEMS="ours-ar ours-engine"
#   ROUNDS=2 CONC=1,2 SYSTEMS="ours-engine" OUT=/tmp/ab benchmarks/served_ab.sh 6643adf
set -euo pipefail
REV=${1:?usage: benchmarks/served_ab.sh REV}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-$ROOT/benchmarks/results/served_ab_$(git -C "$ROOT" rev-parse --short "$REV")}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # REV's arm runs from its worktree: a relative OUT would land there
export REQS=${REQS:-24} CONC=${CONC:-1} SYSTEMS=${SYSTEMS:-"ours-ar ours-engine"}
source "$ROOT/benchmarks/ab_worktree.sh"
for r in $(seq 1 "$ROUNDS"); do
  (cd "$ROOT" && OUT="$OUT/new_$r" ROUNDS=1 benchmarks/peers.sh)
  (cd "$WORK/old" && PY="$ROOT/.venv/bin/python" PYTHONPATH="$OLD_PYTHONPATH" OUT="$OUT/old_$r" ROUNDS=1 \
    benchmarks/peers.sh)
done
"$ROOT/.venv/bin/python" - "$OUT" "$ROUNDS" <<'PY'
import json, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
for system in sorted({p.stem for p in out.glob("new_1/ours-*.json")}):
    for r in range(1, rounds + 1):
        pair = [json.loads((out / f"{arm}_{r}" / f"{system}.json").read_text())["points"] for arm in ("new", "old")]
        for new, old in zip(*pair):
            c, a, b = new["concurrency"], new["output_tok_s"], old["output_tok_s"]
            print(f"{system:12s} round {r} c={c}: new {a:7.1f} old {b:7.1f} tok/s  {a / b - 1:+.1%}")
PY
