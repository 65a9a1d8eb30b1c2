"""The engine's offline throughput on the sweep's own workload, to set against a served `bench sweep` point:
the cpu-small prompts (chat template), 64 output tokens each (EOS ignored), N requests through an engine of R rows
with continuous batching (requests join and leave, prefills interleaved), no HTTP. The gap to the served figure at
concurrency R is what the serving path costs. With --engine DIR, that engine as `serve DIR` runs it (its schedule,
draft tree, lookups, adaptive mode) against the same engine with --no-spec, both in this process, rounds alternating:
the served engine-against-AR ratio without HTTP or the noise between two server processes. Usage:

    .venv/bin/python benchmarks/offline_throughput.py [--rows 8] [--requests 24] [--rounds 3] [--no-spec]
    .venv/bin/python benchmarks/offline_throughput.py --engine engines/smollm2-cpu --rows 4 --requests 12 --rounds 5
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
from dflash_trt.bench.datasets import load_dataset  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.engine_dir import open_engine  # noqa: E402


def _round(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(o.num_tokens for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-spec", action="store_true")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--engine", type=Path, help="an engine directory: it against itself with --no-spec")
    ap.add_argument("--name", default="offline_throughput_cpu")
    args = ap.parse_args()
    if args.engine is not None and (args.no_spec or args.k != ap.get_default("k")):
        ap.error("--engine runs the engine as built against its own --no-spec: -k and --no-spec do not apply")
    torch.set_num_threads(2)
    if args.engine is not None:
        engines = {"engine": open_engine(args.engine, max_batch_size=args.rows),
                   "AR": open_engine(args.engine, max_batch_size=args.rows, speculative=False)}
    else:
        cfg = EngineConfig(dtype="bfloat16", max_batch_size=args.rows, speculative=not args.no_spec,
                           max_draft_len=args.k)
        name = "AR" if args.no_spec else f"DFlash K={args.k}"
        engines = {name: LLMEngine.from_dirs(smollm2_dir(), None if args.no_spec else SMOLLM2_DRAFTER, cfg)}
    first = next(iter(engines.values()))
    prompts = [first.encode(p.text, chat=True) for p in load_dataset("cpu-small", osl=args.osl)][: args.requests]
    params = SamplingParams(max_new_tokens=args.osl, ignore_eos=True)
    for engine in engines.values():
        engine.generate(prompts[: args.rows], params)  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(args.rounds):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))  # neither always runs first
        for name in order:
            samples[name].append(_round(engines[name], prompts, params))
    for name, tok_s in samples.items():
        print(f"{name}: {args.requests} requests x {args.osl} tokens, {args.rows} rows: "
              f"{statistics.median(tok_s):.1f} tok/s (rounds {[round(s, 1) for s in tok_s]})")
    result = {"command": " ".join(sys.argv), "rows": args.rows, "requests": args.requests, "osl": args.osl,
              "runs": {name: {"tok_s_median": round(statistics.median(v), 1), "tok_s": v}
                       for name, v in samples.items()}}
    if len(engines) == 2:
        ratios = [e / a for e, a in zip(samples["engine"], samples["AR"])]
        result["engine_over_ar"] = [round(r, 3) for r in ratios]
        print(f"engine / AR by round: {[round(r, 3) for r in ratios]}, median {statistics.median(ratios):.3f}")
    else:
        (tok_s,) = samples.values()
        result.update(speculative=not args.no_spec, k=None if args.no_spec else args.k,
                      tok_s_median=round(statistics.median(tok_s), 1), tok_s=tok_s)
    path = record(args.name, result)
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
