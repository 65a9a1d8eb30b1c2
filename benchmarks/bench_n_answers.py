"""A request's n answers on the CPU default: one prompt's n copies (prefilled once, the others copying its K/V)
against n different prompts of the same length (each prefilled), side by side in one process.

The engine (SmolLM2-135M-Instruct, bf16, the shipped drafter, n rows, 2 threads) samples n seeded answers of
--max-tokens to a --prompt-len-token window of the bundled benchmark prompts' text; the other arm's n prompts are n
windows of that text at different offsets, as long. Both arms decode the same number of tokens (ignore_eos), so what
differs is the prefill. Per round, each arm once, in alternation after one warm-up each: the wall time of the whole
request and the time until every answer has its first token; the record holds every round and the medians.

    .venv/bin/python benchmarks/bench_n_answers.py [--n 8] [--prompt-len 480] [--max-tokens 32] [--rounds 5]
        [--name n_answers_cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

import dflash_trt  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.sampling_params import SamplingParams  # noqa: E402


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """-> (seconds for the whole batch, seconds until the last first token)."""
    params = [SamplingParams(max_new_tokens=max_tokens, temperature=0.8, seed=s, ignore_eos=True)
              for s in range(len(prompts))]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    total = time.perf_counter() - start
    assert all(o.num_tokens == max_tokens for o in outs)
    return total, max(o.time_to_first_token for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=480)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="n_answers_cpu")
    args = ap.parse_args()

    torch.set_num_threads(2)
    engine = LLMEngine.from_dirs(smollm2_dir(), SMOLLM2_DRAFTER, EngineConfig(dtype="bfloat16", max_batch_size=args.n))
    text = engine.encode((Path(dflash_trt.__file__).parent / "bench" / "prompts.jsonl").read_text())
    stride = (len(text) - args.prompt_len) // max(args.n - 1, 1)
    if stride < 1:
        raise SystemExit(f"the prompt text holds {len(text)} tokens: too few for {args.n} windows of --prompt-len")
    arms = {"one prompt, n copies": [text[: args.prompt_len]] * args.n,
            "n prompts": [text[i * stride: i * stride + args.prompt_len] for i in range(args.n)]}
    for prompts in arms.values():  # warm-up: oneDNN's primitives for every shape
        run(engine, prompts, args.max_tokens)
    rounds = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm, prompts in arms.items():
            total, ttft = run(engine, prompts, args.max_tokens)
            rounds[arm].append({"total_s": round(total, 4), "last_first_token_s": round(ttft, 4)})
            print(f"round {r + 1} {arm}: {total:.3f} s, every first token by {ttft:.3f} s", flush=True)
    medians = {arm: {key: round(statistics.median(x[key] for x in rs), 4) for key in rs[0]}
               for arm, rs in rounds.items()}
    shared, each = medians["one prompt, n copies"], medians["n prompts"]
    ratios = {key: round(each[key] / shared[key], 2) for key in shared}
    print(f"medians: {medians}; n prompts / one prompt's copies: {ratios}")
    path = record(args.name, {"args": vars(args), "rounds": rounds, "medians": medians,
                              "ratio_n_prompts_over_copies": ratios})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
