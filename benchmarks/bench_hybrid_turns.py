"""A chat's next turn on a hybrid target (Qwen3.5): its time to first token with the last turn's prompt taken over
(the row's marks: engine/hybrid_cache.py) against prefilled again (`prefix_reuse` off). The random Qwen3.5 of
benchmarks/bench_qwen3_5.py, bf16, one row, plain decoding: turn 1 a prompt of --prompt tokens and an answer of 32,
turn 2 that, the answer and 40 tokens more; prompts on the CPU's default grid (512-token chunks) or --chunk.

With --shared N the second request is instead another question under the first one's first N tokens (a system
prompt, tools), as long as the first prompt; a third engine keeps a row's last four chunks' marks (the policy before
session 74) to show what the roundest marks take over.

    .venv/bin/python benchmarks/bench_hybrid_turns.py [--prompt 1500] [--shared N] [--chunk 512] [--rounds 3]
        [--name NAME]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qwen3_5 import random_target  # noqa: E402
from common import record  # noqa: E402

from dflash_trt import SamplingParams  # noqa: E402
from dflash_trt.engine import hybrid_cache  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1500)
    ap.add_argument("--shared", type=int, default=0, help="the second request shares this many prompt tokens")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="hybrid_turns_cpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target(random_target(Path(tempfile.mkdtemp()) / "qwen3_5", True), torch.bfloat16)
    cfg = dict(max_batch_size=1, dtype="bfloat16", max_model_len=2 * args.prompt + 256, speculative=False,
               prefill_chunk=args.chunk, max_prefill_tokens=max(512, args.chunk))
    kinds = ["reused", *(["last four marks"] if args.shared else []), "prefilled"]
    engines = {kind: LLMEngine(target, None, None, EngineConfig(prefix_reuse=kind != "prefilled", **cfg))
               for kind in kinds}
    roundest = hybrid_cache._roundness
    g = torch.Generator().manual_seed(0)
    ttft: dict[str, list[float]] = {kind: [] for kind in kinds}
    cached: dict[str, list[int]] = {kind: [] for kind in kinds}
    same = True
    for r in range(args.rounds + 1):  # the first round warms up
        first = torch.randint(2, 31999, (args.prompt,), generator=g).tolist()
        more = torch.randint(2, 31999, (args.prompt - args.shared if args.shared else 40,), generator=g).tolist()
        tokens = None
        for kind, engine in engines.items():
            # the policy before: of the earlier marks, the earliest goes first
            hybrid_cache._roundness = (lambda p: (0, p)) if kind == "last four marks" else roundest
            answer = engine.generate([first], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
            second = first[:args.shared] + more if args.shared else first + answer.token_ids + more
            out = engine.generate([second], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
            if r:
                ttft[kind].append(out.prefill_time * 1000)
                cached[kind].append(out.num_cached_tokens)
                same &= tokens is None or out.token_ids == tokens
                tokens = out.token_ids
    hybrid_cache._roundness = roundest
    med = {k: round(statistics.median(v), 1) for k, v in ttft.items()}
    second_prompt = args.prompt if args.shared else args.prompt + 32 + 40
    path = record(args.name, {"command": " ".join(sys.argv), "prompt": args.prompt, "shared": args.shared,
                              "chunk": args.chunk, "second_prompt": second_prompt, "cached_tokens": cached,
                              "same_tokens": same, "ttft_ms_median": med, "ttft_ms": ttft,
                              "speedup": {k: round(med["prefilled"] / med[k], 2) for k in kinds[:-1]}})
    print(med, "cached", cached, "same tokens", same, "->", path)


if __name__ == "__main__":
    main()
