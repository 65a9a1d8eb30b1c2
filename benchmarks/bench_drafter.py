"""The shipped SmolLM2 drafter on held-out prompts (issue 3): tau and end-to-end speedup against K.

Greedy, batch 1, bf16 (or --dtype float32, where outputs must be identical), 2 threads, through
`dflash_trt.bench.speed` (the engine behind `dflash-trt bench speed`): every held-out prompt runs through this
runtime's --no-spec mode and its speculative mode at each K in the same round; speedup is the ratio of tokens/s
(each system's tokens over its median total wall-clock time). Outputs are compared token for token (bf16 may diverge on near-ties: counted, not hidden).

    .venv/bin/python benchmarks/bench_drafter.py [--drafter drafters/smollm2-135m-dflash] [--prompts 8]
        [--ks 3,7] [--draft-vocab-sizes all,0] [--tree-nodes 0,6] [--lookup-nodes 0,3] [--new-tokens 128] [--rounds 2]
        [--dtype bfloat16|float32]
        [--name drafter_smollm2_cpu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from dflash_trt.bench.cli import parse_vocab_sizes  # noqa: E402
from dflash_trt.bench.datasets import load_dataset  # noqa: E402
from dflash_trt.bench.speed import SpeedConfig, format_table, run_speed  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default=str(SMOLLM2_DRAFTER))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--ks", default="3,7")
    ap.add_argument("--draft-vocab-sizes", default="all", help="all (the drafter's file), 0 (whole vocabulary), N")
    ap.add_argument("--tree-nodes", default="0", help="draft tree sizes at each K (0: a chain), e.g. 0,6")
    ap.add_argument("--lookup-nodes", default="0", help="context lookup branches on each tree (0: none), e.g. 0,3")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="drafter_smollm2_cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    ks = [int(k) for k in args.ks.split(",")]
    engine = LLMEngine.from_dirs(smollm2_dir(), args.drafter, EngineConfig(dtype=args.dtype, max_batch_size=1))
    prompts = load_dataset("heldout", osl=args.new_tokens)[: args.prompts]
    vocabs = parse_vocab_sizes(args.draft_vocab_sizes)
    trees = [int(n) for n in args.tree_nodes.split(",")]
    result = run_speed(engine, prompts, SpeedConfig(draft_lens=ks, rounds=args.rounds, draft_vocab_sizes=vocabs,
                                                    tree_nodes=trees,
                                                    lookup_nodes=[int(n) for n in args.lookup_nodes.split(",")]))
    print(format_table(result))
    ar = result["overall"]["ar"]["tok_s"]
    rows = {name.removeprefix("K="): r | {"ar_tok_s": ar} for name, r in result["overall"].items() if name != "ar"}
    path = record(args.name, {"command": " ".join(sys.argv), "drafter": args.drafter, "dtype": args.dtype,
                              "prompts": len(prompts), "new_tokens": args.new_tokens, "rounds": args.rounds,
                              "results_by_k": rows})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
