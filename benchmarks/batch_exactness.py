"""Do bf16 answers under a batch equal each request's answer alone, decoded plainly? On the CPU default engine
(SmolLM2-135M-Instruct, bf16, the shipped drafter): --batch requests at once, drafting K=--k chains (no tree, no
lookup, no adaptive plain steps, so every step verifies batch x (K + 1) rows), every other one sampled with a seed
(a sampled row takes the whole batch through the full head's logits), against each request alone on the same
engine with speculation off. Arms: the engine as it is (its steps cut to the rows the CPU kernel computes as
one-token steps do, LLMEngine.exact_rows), and with that cut lifted (the behaviour before session 59).

    .venv/bin/python benchmarks/batch_exactness.py [--engine engines/smollm2-135m-cpu] [--batch 8] [--k 4]
        [--prompts 16] [--max-tokens 96] [--name batch_exactness_cpu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from dflash_trt import SamplingParams, open_engine  # noqa: E402
from dflash_trt.bench.datasets import load_dataset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m-cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--name", default="batch_exactness_cpu")
    args = ap.parse_args()

    prompts = [p.text for p in load_dataset("cpu-small")][: args.prompts]
    params = [SamplingParams(max_new_tokens=args.max_tokens, **({"temperature": 0.8, "seed": i} if i % 2 else {}))
              for i in range(len(prompts))]
    plain = open_engine(args.engine, max_batch_size=1, speculative=False)
    alone = [plain.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    schedule = {args.batch: args.k}
    arms = {}
    for arm in ("cut", "uncut"):
        engine = open_engine(args.engine, max_batch_size=args.batch, draft_len_schedule=schedule,
                             draft_len_schedule_without_amx=schedule, draft_tree={}, draft_tree_without_amx={},
                             lookup_nodes=0, adaptive_draft_len=False)
        rows = engine.exact_rows
        if arm == "uncut":
            engine.exact_rows = None
        outs = engine.generate(prompts, params)
        differ = [i for i, (o, a) in enumerate(zip(outs, alone)) if o.token_ids != a]
        steps = sum(len(o.acceptance_lengths) for o in outs)
        arms[arm] = {"differ": len(differ), "differ_ids": differ, "prompts": len(prompts),
                     "tau": round(sum(sum(o.acceptance_lengths) for o in outs) / max(1, steps), 3),
                     "kernel_rows": rows}
        print(f"{arm}: {len(differ)}/{len(prompts)} answers differ from plain decoding alone "
              f"(kernel rows {rows}, tau {arms[arm]['tau']})", flush=True)
    path = record(args.name, {"config": vars(args), "arms": arms})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
