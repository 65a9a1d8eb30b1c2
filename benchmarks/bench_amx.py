"""AMX tiles against AVX-512 rows for the CPU linear kernel: plain and speculative decoding at batch 1, side by side.

On a CPU with AMX the bf16 linear kernel (dflash_trt/kernels/cpu_ops.c) reads its weights in AMX's tile order and
multiplies up to 16 rows per instruction, so a verify step of K + 1 rows costs about what a one-row decode does;
with DFLASH_TRT_AMX=0 it keeps the AVX-512 kernel, whose dot products grow with the rows. The switch is read once
per process, so each variant runs in child processes, alternating, and every child times plain decoding and
DFlash at each K on the same prompts (two per cpu-small category, greedy, bf16, the shipped drafter). Usage:

    .venv/bin/python benchmarks/bench_amx.py [--rounds 2] [--ks 1,2,3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

VARIANTS = {"tiles": "1", "rows": "0"}  # DFLASH_TRT_AMX


def child(ks: list[int], max_tokens: int, per_category: int) -> dict:
    import torch

    from dflash_trt import SamplingParams
    from dflash_trt.bench.datasets import load_dataset
    from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir
    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
    from dflash_trt.kernels import cpu_ops

    torch.set_num_threads(2)
    ops = cpu_ops.load()
    layout = ops.linear_layout(torch.zeros(64, 64, dtype=torch.bfloat16)) if ops is not None else None
    prompts, seen = [], {}
    for p in load_dataset("cpu-small"):
        if seen.get(p.category, 0) < per_category:
            prompts.append(p.text)
            seen[p.category] = seen.get(p.category, 0) + 1
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    out = {"layout": layout, "prompts": len(prompts), "systems": {}}
    for k in [0, *ks]:
        eng = LLMEngine.from_dirs(smollm2_dir(), SMOLLM2_DRAFTER if k else None,
                                  EngineConfig(max_batch_size=1, speculative=bool(k), max_draft_len=max(k, 1),
                                               dtype="bfloat16"))
        ids = [eng.encode(text, chat=True) for text in prompts]
        eng.generate([ids[0]], params)  # warm-up
        start = time.perf_counter()
        results = [eng.generate([i], params)[0] for i in ids]
        elapsed = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        out["systems"]["ar" if k == 0 else f"K={k}"] = {
            "tok_s": tokens / elapsed, "tau": None if k == 0 else statistics.mean(r.tau for r in results),
            "outputs": [list(r.token_ids) for r in results]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if args.child:
        print(json.dumps(child(ks, args.max_tokens, args.per_category)))
        return
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name, flag in VARIANTS.items():
            cmd = [sys.executable, __file__, "--child", "--ks", args.ks, "--max-tokens", str(args.max_tokens),
                   "--per-category", str(args.per_category)]
            env = {**os.environ, "DFLASH_TRT_AMX": flag}
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            runs[name].append(res)
            print(f"round {r + 1} {name} (layout {res['layout']}): "
                  + ", ".join(f"{s} {v['tok_s']:.1f} tok/s" for s, v in res["systems"].items()), flush=True)
    if runs["tiles"][0]["layout"] != "tiles":
        sys.exit("this CPU has no AMX (or the kernels are off): both variants ran the same kernel")
    summary = {}
    for name, rs in runs.items():
        systems = {}
        for s in rs[0]["systems"]:
            tok_s = statistics.median(x["systems"][s]["tok_s"] for x in rs)
            ar = statistics.median(x["systems"]["ar"]["tok_s"] for x in rs)
            outs, ar_outs = rs[0]["systems"][s]["outputs"], rs[0]["systems"]["ar"]["outputs"]
            systems[s] = {"tok_s": round(tok_s, 1), "tau": rs[0]["systems"][s]["tau"],
                          "speedup": round(tok_s / ar, 3),
                          "identical_to_ar": sum(a == b for a, b in zip(outs, ar_outs))}
        summary[name] = systems
    for s in summary["tiles"]:
        a, b = runs["tiles"][0]["systems"][s]["outputs"], runs["rows"][0]["systems"][s]["outputs"]
        summary["tiles"][s]["identical_to_rows"] = sum(x == y for x, y in zip(a, b))
    print(f"{'system':8s} {'rows tok/s':>11s} {'tiles tok/s':>12s} {'rows speedup':>13s} {'tiles speedup':>14s}")
    for s in summary["tiles"]:
        r, t = summary["rows"][s], summary["tiles"][s]
        print(f"{s:8s} {r['tok_s']:11.1f} {t['tok_s']:12.1f} {r['speedup']:12.2f}x {t['speedup']:13.2f}x")
    path = record("amx_tiles_vs_rows", {"rounds": args.rounds, "max_tokens": args.max_tokens,
                                        "prompts": runs["tiles"][0]["prompts"], "summary": summary})
    print("recorded", path)


if __name__ == "__main__":
    main()
