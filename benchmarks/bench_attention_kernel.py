"""The CPU kernels' cached attention against an earlier revision of the same kernels, side by side in one process.

Builds dflash_trt/kernels/cpu_ops.c as it was at --baseline (a git revision) next to the working tree's build and
times both, alternating: the attention op alone (SmolLM2's 9 query / 3 KV heads of 64, one row's 1 or 3 queries,
as a decode and a K=2 verify step issue them, over L cached keys), and SmolLM2-135M's 30 decoder layers in one call
(the model's forward without the output head, bf16) for 1 and 3 tokens at context L, where attention is what grows
with L. Both builds must give the same outputs bit for bit (checked here; the kernels' layout of the linear weights
must not have changed between them). Usage:

    .venv/bin/python benchmarks/bench_attention_kernel.py --baseline REV [--rounds 5] [--contexts 16,128,512,1024]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import per_call_us, record  # noqa: E402

from dflash_trt.embedded import smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import DTYPES  # noqa: E402
from dflash_trt.kernels import cpu_ops  # noqa: E402
from dflash_trt.layers.attention import AttentionMetadata  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402

SOURCES = ("cpu_ops.c", "cpu_ops_body.h")
CAPTURE = (1, 8, 14, 20, 27)  # the shipped drafter's target layers: the features a speculative step captures


def build_at(rev: str, out: Path) -> cpu_ops.CpuOps:
    """The kernels as they were at git revision `rev`, compiled with the runtime's own flags."""
    for name in SOURCES:
        text = subprocess.check_output(["git", "show", f"{rev}:dflash_trt/kernels/{name}"], text=True)
        (out / name).write_text(text)
    lib = out / "cpu_ops.so"
    subprocess.run(["cc", *cpu_ops._FLAGS, str(out / "cpu_ops.c"), "-o", str(lib)], check=True)
    return cpu_ops.CpuOps(ctypes.CDLL(str(lib)))


def op_timings(builds: dict, contexts: list[int], rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, max(contexts) + 4, 64, generator=g).bfloat16()
    v = torch.randn(1, 3, max(contexts) + 4, 64, generator=g).bfloat16()
    out = []
    for length in contexts:
        for queries in (1, 3):
            q = torch.randn(queries, 9, 64, generator=g).bfloat16()
            rows, lens = torch.zeros(queries, dtype=torch.long), torch.arange(length, length + queries)
            results = {name: ops.cached_attention(q, k, v, rows, lens, 0.125) for name, ops in builds.items()}
            assert torch.equal(*results.values()), f"the builds disagree at L={length}, {queries} queries"
            times = {name: [] for name in builds}
            for _ in range(rounds):  # interleaved
                for name, ops in builds.items():
                    times[name].append(per_call_us(lambda: ops.cached_attention(q, k, v, rows, lens, 0.125), 200, 1))
            out.append({"context": length, "queries": queries,
                        **{f"{name}_us": round(statistics.median(t), 1) for name, t in times.items()}})
            print(out[-1], flush=True)
    return out


def layer_timings(builds: dict, contexts: list[int], rounds: int) -> list[dict]:
    target = load_target(smollm2_dir(), DTYPES["bfloat16"], "cpu")
    target.pack_for_inference()
    cache = target.make_cache(1, max(contexts) + 8)
    real_load = cpu_ops.load
    out = []
    try:
        with torch.inference_mode():
            for length in contexts:
                for tokens in (1, 3):
                    x = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(length))
                    meta = AttentionMetadata.causal_step(torch.tensor([0]), (length + torch.arange(tokens))[None])
                    times, outputs = {name: [] for name in builds}, {}
                    for _ in range(rounds):  # interleaved
                        for name, ops in builds.items():
                            cpu_ops.load = lambda ops=ops: ops  # noqa: B023 - the model looks the kernels up per call
                            outputs[name] = target(x, meta, cache, CAPTURE)[0].clone()
                            times[name].append(per_call_us(lambda: target(x, meta, cache, CAPTURE), 30, 1) / 1e3)
                    assert torch.equal(*outputs.values()), f"the builds disagree at L={length}, {tokens} tokens"
                    out.append({"context": length, "tokens": tokens,
                                **{f"{name}_ms": round(statistics.median(t), 3) for name, t in times.items()}})
                    print(out[-1], flush=True)
    finally:
        cpu_ops.load = real_load
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="git revision whose kernels to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--contexts", default="16,128,512,1024")
    ap.add_argument("--name", default="attention_kernel_cpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    contexts = [int(c) for c in args.contexts.split(",")]
    current = cpu_ops.load()
    if current is None:
        sys.exit("the CPU kernels are unavailable here (no compiler, or DFLASH_TRT_CPU_KERNELS=0)")
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"baseline": build_at(args.baseline, Path(tmp)), "current": current}
        ops = op_timings(builds, contexts, args.rounds)
        layers = layer_timings(builds, contexts, args.rounds)
    path = record(args.name, {
        "command": "benchmarks/bench_attention_kernel.py " + " ".join(sys.argv[1:]),
        "baseline": subprocess.check_output(["git", "rev-parse", "--short", args.baseline], text=True).strip(),
        "setup": "2 threads, bf16; op: one row's queries over L keys (9 / 3 heads of 64), median us per call; "
                 "layers: SmolLM2-135M's 30 decoder layers in one call, median ms; builds alternated",
        "attention_op": ops,
        "decoder_layers": layers,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
