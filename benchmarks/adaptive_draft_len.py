"""The adaptive draft length at batch 1 (issue 8, goal 2): plain decoding, a fixed K and the adaptive mode on the
sweep's cpu-small prompts, side by side in each round, with the K the adaptive mode chose on each step.

Greedy, bf16, 2 threads, one engine per system kept across the prompts (as a server keeps it; the adaptive mode's
measurements carry over from one request to the next), each warmed up on every prompt (8 tokens) before timing.
Outputs are compared with plain decoding's token for token (bf16 near-ties: counted, not hidden).

    .venv/bin/python benchmarks/adaptive_draft_len.py [--drafter drafters/smollm2-135m-dflash] [-k 2]
        [--max-tokens 64] [--rounds 2] [--name adaptive_draft_len_cpu]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from dflash_trt import SamplingParams  # noqa: E402
from dflash_trt.bench.datasets import load_dataset  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402

SYSTEMS = {"ar": {"speculative": False}, "fixed": {}, "adaptive": {"adaptive_draft_len": True}}


def run(name: str, drafter: str, k: int, prompts: list[str], max_tokens: int) -> dict:
    cfg = EngineConfig(dtype="bfloat16", max_batch_size=1, max_draft_len=k, **SYSTEMS[name])
    engine = LLMEngine.from_dirs(smollm2_dir(), drafter if cfg.speculative else None, cfg)
    ids = [engine.encode(p, chat=True) for p in prompts]
    # oneDNN builds a primitive per new shape, process-wide: every prompt's prefill shapes are built before timing,
    # or whichever system runs first pays for them
    for i in ids:
        engine.generate([i], SamplingParams(max_new_tokens=8))
    chosen = collections.Counter()
    if engine.adaptive is not None:
        choose = engine.adaptive.choose

        def counting(batch_size: int, k: int) -> int:
            picked = choose(batch_size, k)
            chosen[picked] += 1
            return picked

        engine.adaptive.choose = counting
    start = time.perf_counter()
    outs = [engine.generate([i], SamplingParams(max_new_tokens=max_tokens))[0] for i in ids]
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    taus = [a for o in outs for a in o.acceptance_lengths]
    return {"tok_s": tokens / elapsed, "tokens": tokens, "tau": statistics.mean(taus) if taus else None,
            "steps_by_k": {str(k): n for k, n in sorted(chosen.items())}, "outputs": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default=str(SMOLLM2_DRAFTER))
    ap.add_argument("-k", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="adaptive_draft_len_cpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    prompts = [p.text for p in load_dataset("cpu-small", osl=args.max_tokens)]
    rounds = []
    for r in range(args.rounds):
        results = {name: run(name, args.drafter, args.k, prompts, args.max_tokens) for name in SYSTEMS}
        plain = results["ar"]["outputs"]
        for name, res in results.items():
            res["vs_ar"] = res["tok_s"] / results["ar"]["tok_s"]
            res["identical_to_ar"] = sum(o == a for o, a in zip(res["outputs"], plain))
            print(f"round {r}  {name:9s} {res['tok_s']:7.1f} tok/s  {res['vs_ar']:.3f}x  tau "
                  f"{res['tau'] or 0:.2f}  steps by K {res['steps_by_k']}  identical {res['identical_to_ar']}/{len(prompts)}",
                  flush=True)
        for res in results.values():
            del res["outputs"]
        rounds.append(results)
    medians = {name: statistics.median(rd[name]["vs_ar"] for rd in rounds) for name in SYSTEMS}
    print("median vs ar:", {n: round(v, 3) for n, v in medians.items()})
    path = record(args.name, {"command": " ".join(sys.argv), "drafter": args.drafter, "k": args.k,
                              "prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": rounds,
                              "median_vs_ar": medians})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
