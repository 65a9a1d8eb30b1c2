"""Prefill grids side by side on the CPU default: what each --prefill-chunk costs a lone prompt, and what it saves a
chat's next turn, in one process.

One engine per grid (SmolLM2-135M-Instruct, bf16, the shipped drafter, one row, 2 threads), run in alternation after
a warm-up each. Per grid:
- lone: one token answered to the first N tokens of the bundled benchmark prompts' text (N in --lengths), nothing to
  take over (its row forgotten first): prefill plus the first token;
- next turn: a --turn-len-token prompt answered with --max-tokens tokens, then the next turn (that prompt, its answer
  and a short message), whose row holds the first turn's whole chunks: the next turn's first token.

    .venv/bin/python benchmarks/bench_prefill_grid.py [--grids 32,256] [--lengths 100,200,400,800]
        [--turn-len 300] [--max-tokens 32] [--rounds 5] [--name prefill_grid_cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

import dflash_trt  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.sampling_params import SamplingParams  # noqa: E402


def runs(engine: LLMEngine, text: list[int], lengths: list[int], turn_len: int, max_tokens: int) -> dict:
    """{arm: a run's first-token seconds} for one engine."""
    one = SamplingParams(max_new_tokens=1)
    first = text[:turn_len]
    answer = engine.generate([first], SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))[0].token_ids
    following = first + answer + engine.encode("\nAnd what comes next?")

    def lone(n: int) -> float:
        engine.scheduler.forget_resident()
        return engine.generate([text[:n]], one)[0].time_to_first_token

    def next_turn() -> float:
        engine.scheduler.forget_resident()
        engine.generate([first], SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))
        return engine.generate([following], one)[0].time_to_first_token

    return {**{f"lone {n}": (lambda n=n: lone(n)) for n in lengths}, f"next turn of {len(following)}": next_turn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grids", default="32,256")
    ap.add_argument("--lengths", default="100,200,400,800")
    ap.add_argument("--turn-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="prefill_grid_cpu")
    args = ap.parse_args()

    torch.set_num_threads(2)
    grids = [int(g) for g in args.grids.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    engines = {g: LLMEngine.from_dirs(smollm2_dir(), SMOLLM2_DRAFTER,
                                      EngineConfig(dtype="bfloat16", max_batch_size=1, prefill_chunk=g))
               for g in grids}
    text = engines[grids[0]].encode((Path(dflash_trt.__file__).parent / "bench" / "prompts.jsonl").read_text())
    arms = {g: runs(e, text, lengths, args.turn_len, args.max_tokens) for g, e in engines.items()}
    for g in grids:  # warm-up: oneDNN's primitives for every shape
        for arm in arms[g].values():
            arm()
    seconds = {g: {name: [] for name in arms[g]} for g in grids}
    for r in range(args.rounds):
        for name in arms[grids[0]]:
            for g in grids:
                seconds[g][name].append(round(arms[g][name](), 4))
        print(f"round {r + 1}: " + "; ".join(f"grid {g}: {[v[-1] for v in seconds[g].values()]}" for g in grids),
              flush=True)
    medians = {g: {name: round(statistics.median(v) * 1000, 1) for name, v in seconds[g].items()} for g in grids}
    for name in arms[grids[0]]:
        print(f"{name}: " + " / ".join(f"grid {g} {medians[g][name]} ms" for g in grids))
    path = record(args.name, {"args": vars(args), "seconds": {str(g): v for g, v in seconds.items()},
                              "median_ms": {str(g): v for g, v in medians.items()}})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
