"""Where a decode step's time goes at batch 1: plain decoding against speculative steps at one K, part by part.

Timers wrap the runtime's own calls (engine step, target forward, greedy choice, drafter step and head, pending
features) while the engine generates for the `cpu-small` prompts, greedy, bf16, 2 threads, after a warm-up pass.
Timing inside the loop, not in isolation, is the point: between two forwards that stream the weights through the
caches, a small torch op costs 5-20x what a microbenchmark of it says (benchmarks/README.md, session 15).

    .venv/bin/python benchmarks/profile_step.py [--k 2] [--tree-nodes 6] [--prompts 12] [--new-tokens 64]
        [--name profile_step_cpu] [--compare screen_head]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from dflash_trt.bench.datasets import load_dataset  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.sampling_params import SamplingParams  # noqa: E402


def timed(obj, name: str, key: str, samples: dict[str, list[float]]) -> None:
    """Replace obj.name by a wrapper that appends each call's seconds to samples[key]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        samples[key].append(time.perf_counter() - start)
        return out

    setattr(obj, name, wrapper)


def profile(speculative: bool, k: int, prompts: list[str], new_tokens: int, tree_nodes: int = 0, **config) -> dict:
    tree = {1: tree_nodes} if tree_nodes else {}
    engine = LLMEngine.from_dirs(smollm2_dir(), SMOLLM2_DRAFTER, EngineConfig(
        dtype="bfloat16", max_batch_size=1, max_draft_len=k, speculative=speculative, draft_tree=tree,
        draft_len_schedule={}, **config))
    ids = [engine.encode(p, chat=True) for p in prompts]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(ids[:2], params)  # warm-up: kernels built, shapes seen
    samples: dict[str, list[float]] = defaultdict(list)
    runner = engine.runner
    timed(engine, "step", "engine step", samples)
    step = "decode_step" if not speculative else "tree_step" if tree_nodes else "spec_step"
    timed(runner, step, "decode step", samples)
    timed(runner, "prefill", "prefill", samples)
    timed(runner.target, "forward", "target forward", samples)
    timed(runner.target, "greedy_tokens", "target head + argmax", samples)
    if speculative:
        proposer = runner.proposer
        timed(proposer, "propose_tree" if tree_nodes else "propose", "propose (all)", samples)
        timed(proposer.drafter, "draft", "drafter step", samples)
        timed(proposer.drafter, "compute_logits", "draft head", samples)
        timed(runner, "_pending_batch", "pending features", samples)
    start = time.perf_counter()
    outputs = engine.generate(ids, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = len(samples["decode step"])
    prefills = len(samples["prefill"])
    parts = {}
    for key, values in samples.items():
        total = sum(values)
        if key == "target forward":  # prefill forwards are timed here too: report the decode steps' own
            total -= sum(sorted(values, reverse=True)[:prefills])
        parts[key] = {"calls": len(values), "ms_per_decode_step": round(total / steps * 1e3, 3),
                      "median_ms": round(statistics.median(values) * 1e3, 3)}
    return {"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2), "decode_steps": steps,
            "tokens_per_step": round(tokens / steps, 3), "parts": parts, "token_ids": [o.token_ids for o in outputs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tree-nodes", type=int, default=0, help="draft trees of this many nodes (0: chains)")
    ap.add_argument("--name", default="profile_step_cpu")
    switches = [f.name for f in fields(EngineConfig) if f.type in (bool, "bool")]
    ap.add_argument("--compare", metavar="FIELD", choices=switches,
                    help="an EngineConfig switch (screen_head, int8_drafter, ...): each run also with it off, "
                    "alternating")
    args = ap.parse_args()
    torch.set_num_threads(2)
    prompts = [p.text for p in load_dataset("cpu-small", osl=args.new_tokens)[: args.prompts]]
    runs = {}
    plan = [("ar", False), (f"K={args.k}", True), ("ar again", False), (f"K={args.k} again", True)]
    off = f", {args.compare} off"
    if args.compare:
        plan = [(f"{name}{suffix}", spec, config) for name, spec in plan
                for suffix, config in (("", {}), (off, {args.compare: False}))]
    else:
        plan = [(name, spec, {}) for name, spec in plan]
    tokens = {}
    for name, spec, config in plan:
        runs[name] = profile(spec, args.k, prompts, args.new_tokens, args.tree_nodes, **config)
        tokens[name] = runs[name].pop("token_ids")
        if args.compare and name.endswith(off):
            runs[name]["identical_to_on"] = tokens[name] == tokens[name.removesuffix(off)]
        r = runs[name]
        print(f"{name}: {r['tok_s']} tok/s, {r['decode_steps']} steps of {r['tokens_per_step']} tokens")
        for key, part in r["parts"].items():
            print(f"  {key:22s} {part['ms_per_decode_step']:7.3f} ms a step  (median call {part['median_ms']:.3f} ms)")
    path = record(args.name, {"command": " ".join(sys.argv), "k": args.k, "tree_nodes": args.tree_nodes,
                              "prompts": len(prompts),
                              "new_tokens": args.new_tokens, "runs": runs})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
