"""A SmolLM2 drafter training step in fp32 against bf16 autocast on this CPU, side by side (issue 3), and the feature
cache's prefill in each (the CLI computes it with the target's fp32 twin where the CPU emulates bf16).

The training step follows the CLI's CPU path: the target's features cached on disk (the first --records training records and 4 held-out ones),
the shipped drafter warm-started, its recipe (4 sequences x 48 anchors, distillation 0.5, steered anchors 0.5, draft
vocabulary 2,048), through Trainer.train_step. Each precision runs one warm-up step and --steps timed ones on the same
sequence draws, in the order given (repeat one to see the machine's drift). The trainer picks the precision by
hardware.native_bf16.

    .venv/bin/python benchmarks/bench_train_precision.py --order fp32,bf16,fp32 --name train_precision_cpu
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import record  # noqa: E402
from dflash_trt.embedded import smollm2_dir  # noqa: E402
from dflash_trt.hardware import native_bf16  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402
from dflash_trt.train.cli import feature_target  # noqa: E402
from dflash_trt.train.feature_cache import TargetFeatures, build_feature_cache  # noqa: E402
from dflash_trt.train.trainer import TrainConfig, Trainer  # noqa: E402

DRAFTER = ROOT / "drafters" / "smollm2-135m-dflash"
RECORDS = DRAFTER / "training-data" / "responses.jsonl.gz"
LAYER_IDS = [1, 8, 14, 20, 27]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--order", default="fp32,bf16,fp32")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--records", type=int, default=60)
    ap.add_argument("--name", help="record benchmarks/results/NAME.json")
    args = ap.parse_args()
    with gzip.open(RECORDS, "rt") as f:
        recs = [json.loads(line) for _, line in zip(range(3000), f)]
    recs = [r for r in recs if r["split"] == "train"][: args.records] + [r for r in recs if r["split"] == "heldout"][:4]
    target_dir = smollm2_dir()
    target = load_target(target_dir, torch.bfloat16, "cpu")
    prefill = {}
    two = [recs[0], recs[1]]
    lengths = [min(len(r["prompt_ids"]) + len(r["response_ids"]), 640) for r in two]
    for name, model in (("fp32", load_target(target_dir, torch.float32, "cpu")), ("bf16", target)):
        source = TargetFeatures(model, LAYER_IDS)
        source.batch(two, lengths)  # warm-up
        t0 = time.perf_counter()
        source.batch(two, lengths)
        prefill[name] = round(sum(lengths) / (time.perf_counter() - t0), 1)
        print(f"feature prefill in {name}: {prefill[name]} tok/s ({sum(lengths)} tokens)", flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        sequences = [(r["id"], (r["prompt_ids"] + r["response_ids"])[:640]) for r in recs]
        feats = build_feature_cache(target, sequences, Path(tmp) / "features", LAYER_IDS,
                                    compute_with=lambda: feature_target(target, target_dir))
        for i, mode in enumerate(args.order.split(",")):
            cfg = TrainConfig(num_layers=2, block_size=8, target_layer_ids=LAYER_IDS, mask_token_id=16, steps=10**6,
                              lr=3e-4, seqs_per_step=4, anchors_per_seq=48, gamma=2.0, max_seq_len=640,
                              eval_every=10**6, eval_prompts=0, distill=0.5, steer_anchors=0.5, draft_vocab_size=2048,
                              init_drafter=str(DRAFTER), bf16_autocast={"bf16": True, "fp32": False}[mode])
            tr = Trainer(target, target_dir, None, recs, feats, Path(tmp) / f"run{i}", cfg)
            tr.drafter.train()
            tr.train_step()  # warm-up
            t0 = time.perf_counter()
            losses = [tr.train_step()["loss"] for _ in range(args.steps)]
            per = (time.perf_counter() - t0) / args.steps
            runs.append({"precision": mode, "s_per_step": round(per, 3), "losses": [round(x, 4) for x in losses]})
            print(f"{mode}: {per:.2f} s a step, losses {runs[-1]['losses']}", flush=True)
    out = {"command": " ".join(sys.argv), "native_bf16": native_bf16("cpu"), "feature_prefill_tok_s": prefill,
           "runs": runs}
    if args.name:
        print(record(args.name, out))


if __name__ == "__main__":
    main()
