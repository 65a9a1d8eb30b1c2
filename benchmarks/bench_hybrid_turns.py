"""A chat's next turn on a hybrid target (Qwen3.5): its time to first token with the last turn's prompt taken over
(the row's marks: engine/hybrid_cache.py) against prefilled again (`prefix_reuse` off). The random Qwen3.5 of
benchmarks/bench_qwen3_5.py, bf16, one row, plain decoding: turn 1 a prompt of --prompt tokens and an answer of 32,
turn 2 that, the answer and 40 tokens more; prompts on the CPU's default grid (512-token chunks) or --chunk.

    .venv/bin/python benchmarks/bench_hybrid_turns.py [--prompt 1500] [--chunk 512] [--rounds 3] [--name NAME]
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
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1500)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="hybrid_turns_cpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target(random_target(Path(tempfile.mkdtemp()) / "qwen3_5", True), torch.bfloat16)
    cfg = dict(max_batch_size=1, dtype="bfloat16", max_model_len=2 * args.prompt + 256, speculative=False,
               prefill_chunk=args.chunk, max_prefill_tokens=max(512, args.chunk))
    engines = {reuse: LLMEngine(target, None, None, EngineConfig(prefix_reuse=reuse, **cfg)) for reuse in (True, False)}
    g = torch.Generator().manual_seed(0)
    ttft: dict[str, list[float]] = {"reused": [], "prefilled": []}
    cached, same = [], True
    for r in range(args.rounds + 1):  # the first round warms up
        first = torch.randint(2, 31999, (args.prompt,), generator=g).tolist()
        more = torch.randint(2, 31999, (40,), generator=g).tolist()
        for reuse, engine in engines.items():
            answer = engine.generate([first], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
            out = engine.generate([first + answer.token_ids + more], SamplingParams(max_new_tokens=4,
                                                                                     ignore_eos=True))[0]
            if r:
                ttft["reused" if reuse else "prefilled"].append(out.prefill_time * 1000)
                if reuse:
                    cached.append(out.num_cached_tokens)
                    tokens = out.token_ids
                else:
                    same &= out.token_ids == tokens
    med = {k: round(statistics.median(v), 1) for k, v in ttft.items()}
    path = record(args.name, {"command": " ".join(sys.argv), "prompt": args.prompt, "chunk": args.chunk,
                              "second_turn_prompt": args.prompt + 32 + 40, "cached_tokens": cached,
                              "same_tokens": same, "ttft_ms_median": med, "ttft_ms": ttft,
                              "speedup": round(med["prefilled"] / med["reused"], 2)})
    print(med, "cached", cached, "same tokens", same, "->", path)


if __name__ == "__main__":
    main()
