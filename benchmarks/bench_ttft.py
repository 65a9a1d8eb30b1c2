"""Time to first token by prompt length on the CPU default: this working tree against another commit, side by side.

The engine (SmolLM2-135M-Instruct, bf16, the shipped drafter, one row, 2 threads) answers one token to the first N
tokens of a fixed text (the bundled benchmark prompts), N in --lengths: prefill plus the first token, the median of
--repeats after two warm-ups. With --rev, each round runs this script's measurement under a worktree of REV too, in
alternation (its package imported from the worktree: PYTHONPATH, checked by the file it imports), so both see the
same drift of a noisy machine; the record holds each round and the ratio of the medians.

    .venv/bin/python benchmarks/bench_ttft.py [--rev b1653a8] [--rounds 2] [--lengths 24,48,96,160,256,400]
        [--name ttft_cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(lengths: list[int], repeats: int) -> dict:
    """{"package": the dflash_trt imported, "ms": {N: median TTFT in ms}} for this process's dflash_trt."""
    import torch

    import dflash_trt
    from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir
    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
    from dflash_trt.sampling_params import SamplingParams

    torch.set_num_threads(2)
    engine = LLMEngine.from_dirs(smollm2_dir(), SMOLLM2_DRAFTER, EngineConfig(dtype="bfloat16", max_batch_size=1))
    text = (Path(dflash_trt.__file__).parent / "bench" / "prompts.jsonl").read_text()
    ids = engine.encode(text)
    if len(ids) < max(lengths):
        raise SystemExit(f"the prompt text holds {len(ids)} tokens, fewer than --lengths' {max(lengths)}")
    params = SamplingParams(max_new_tokens=1)
    ms = {}
    for n in lengths:
        times = []
        for _ in range(repeats + 2):
            engine.scheduler.forget_resident()  # or the row would hand the last call's prompt chunks to this one
            start = time.perf_counter()
            engine.generate([ids[:n]], params)
            times.append(time.perf_counter() - start)
        ms[n] = round(statistics.median(times[2:]) * 1e3, 2)
    return {"package": dflash_trt.__file__, "ms": ms}


def measure_elsewhere(checkout: Path, lengths: list[int], repeats: int) -> dict:
    """measure() in a child process importing dflash_trt from `checkout`."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_ttft; "
            f"print(json.dumps(bench_ttft.measure({lengths!r}, {repeats})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
                         capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if not result["package"].startswith(str(checkout)):
        raise SystemExit(f"{checkout}: imported {result['package']} instead")
    result["ms"] = {int(n): v for n, v in result["ms"].items()}
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", help="a commit to compare with, run from a temporary worktree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", default="24,48,96,160,256,400")
    ap.add_argument("--name", default="ttft_cpu")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import record

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        if args.rev:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.rev], check=True,
                           capture_output=True)
        try:
            for r in range(args.rounds):
                new = measure_elsewhere(ROOT, lengths, args.repeats)
                rounds.append({"new": new["ms"], **({"old": measure_elsewhere(old, lengths, args.repeats)["ms"]}
                                                    if args.rev else {})})
                print(f"round {r + 1}: {json.dumps(rounds[-1])}", flush=True)
        finally:
            if args.rev:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    summary = {}
    for n in lengths:
        row = {"new_ms": statistics.median(r["new"][n] for r in rounds)}
        if args.rev:
            row["old_ms"] = statistics.median(r["old"][n] for r in rounds)
            row["old_over_new"] = round(row["old_ms"] / row["new_ms"], 3)
        summary[n] = row
        print(f"{n:5d} tokens: " + "  ".join(f"{k} {v}" for k, v in row.items()))
    path = record(args.name, {"command": " ".join(sys.argv), "rev": args.rev, "lengths": lengths,
                              "repeats": args.repeats, "rounds": rounds, "summary": summary})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
