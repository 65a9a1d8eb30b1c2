"""The shipped SmolLM2 drafter on held-out prompts (issue 3): tau and end-to-end speedup against K.

Greedy, batch 1, bf16 (or --dtype float32, where outputs must be identical), 2 threads. For each K, every held-out prompt runs through this runtime's
--no-spec mode and its speculative mode in the same round (rounds interleaved); speedup is the ratio of
total wall-clock time. Outputs are compared token for token (bf16 may diverge on near-ties: counted,
not hidden). Usage:

    .venv/bin/python benchmarks/bench_drafter.py [--drafter drafters/smollm2-135m-dflash] [--prompts 8]
        [--ks 3,7,15] [--new-tokens 128] [--rounds 2] [--dtype bfloat16|float32] [--name drafter_smollm2_cpu]
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

from dflash_trt import SamplingParams  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.models.dflash import load_drafter  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402
from dflash_trt.train.prompts import all_prompts  # noqa: E402


def heldout_prompts(n: int) -> list[str]:
    return [p.text for p in all_prompts() if p.split == "heldout"][:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default=str(SMOLLM2_DRAFTER))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--ks", default="3,7,15")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="drafter_smollm2_cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoTokenizer

    tdir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(tdir)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    target = load_target(tdir, dtype)
    drafter = load_drafter(args.drafter, target.config, dtype)
    ks = [int(k) for k in args.ks.split(",")]
    cfg = dict(max_batch_size=1, dtype=args.dtype)
    ar = LLMEngine(target, tok, None, EngineConfig(speculative=False, **cfg))
    specs = {k: LLMEngine(target, tok, drafter, EngineConfig(max_draft_len=k, **cfg)) for k in ks}
    prompts = [ar.encode(p, chat=True) for p in heldout_prompts(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens)

    def timed(engine, p):
        t = time.perf_counter()
        out = engine.generate([p], params)[0]
        return time.perf_counter() - t, out

    for e in [ar, *specs.values()]:  # warm-up
        timed(e, prompts[0])
    ar_wall = [0.0] * args.rounds
    spec_wall = {k: [0.0] * args.rounds for k in ks}
    ar_tokens, same, steps, committed = 0, {k: 0 for k in ks}, {k: 0 for k in ks}, {k: 0 for k in ks}
    hist = {k: [0] * (k + 1) for k in ks}
    for r in range(args.rounds):
        for p in prompts:
            wall, base = timed(ar, p)
            ar_wall[r] += wall
            if r == 0:
                ar_tokens += base.num_tokens
            for k in ks:
                wall, out = timed(specs[k], p)
                spec_wall[k][r] += wall
                if r == 0:
                    same[k] += out.token_ids == base.token_ids
                    steps[k] += len(out.acceptance_lengths)
                    committed[k] += sum(out.acceptance_lengths)
                    hist[k] = [a + b for a, b in zip(hist[k], out.acceptance_histogram)]
    ar_med = statistics.median(ar_wall)
    rows = {}
    for k in ks:
        med = statistics.median(spec_wall[k])
        rows[k] = {"tau": committed[k] / steps[k], "speedup": ar_med / med, "ar_tok_s": ar_tokens / ar_med,
                   "spec_tok_s": ar_tokens / med, "identical_outputs": f"{same[k]}/{len(prompts)}",
                   "acceptance_histogram": hist[k]}
        print(f"K={k:2d}  tau {rows[k]['tau']:.2f}  speedup {rows[k]['speedup']:.2f}x  "
              f"AR {rows[k]['ar_tok_s']:.1f} tok/s  DFlash {rows[k]['spec_tok_s']:.1f} tok/s  identical {rows[k]['identical_outputs']}")
    path = record(args.name, {"command": " ".join(sys.argv), "drafter": args.drafter, "dtype": args.dtype,
                              "prompts": len(prompts), "new_tokens": args.new_tokens, "rounds": args.rounds,
                              "results_by_k": rows})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
