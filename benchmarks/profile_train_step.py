"""Where a training step's time goes (issue 3): phase timings and the top ops of a few profiled steps.

The 2026-12-04 H200 leg ran 128-sequence steps at ~11 s each with the GPU mostly idle (benchmarks/README.md), and
the smoke target's 32-sequence steps at ~1 s: this measures the phases (features, steering probe, loss, backward,
optimizer) one by one, synchronized, on a random target of SmolLM2-135M's shape and synthetic records, then runs
torch.profiler over a few steps. Needs no checkpoint, so a single device call can run it:

    python3 benchmarks/profile_train_step.py --device cuda --seqs 128
    .venv/bin/python benchmarks/profile_train_step.py --device cpu --seqs 4 --layers 4   # a quick check here
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_trt.models.registry import load_target  # noqa: E402
from dflash_trt.train.feature_cache import TargetFeatures  # noqa: E402
from dflash_trt.train.trainer import TrainConfig, Trainer  # noqa: E402
from tests.conftest import make_target  # noqa: E402

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     max_position_embeddings=2048, vocab=49152)
LAYER_IDS = [1, 8, 14, 20, 27]


def synthetic_records(n: int, gen: torch.Generator) -> list[dict]:
    """Token-id records of the real data's lengths (prompts ~40-120, responses ~100-256) over 4k common ids."""
    out = []
    for i in range(n):
        p = int(torch.randint(40, 120, (1,), generator=gen))
        r = int(torch.randint(100, 256, (1,), generator=gen))
        ids = torch.randint(3, 4096, (p + r,), generator=gen).tolist()
        out.append({"id": f"{i}:greedy", "source": "synthetic", "split": "heldout" if i % 20 == 0 else "train",
                    "mode": "greedy", "prompt_ids": ids[:p], "response_ids": ids[p:]})
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_step(tr: Trainer, timings: dict[str, float]) -> None:
    """Trainer.train_step, each phase timed after a sync."""
    t = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t
        sync(tr.device)
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - t
        t = now

    tr.train_step(phase)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--layers", type=int, default=30, help="target depth (30: SmolLM2-135M)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up ones")
    ap.add_argument("--profile-steps", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = make_target(Path(tmp) / "target", arch="llama", layers=args.layers, **SMOLLM2_SHAPE)
        target = load_target(target_dir, torch.bfloat16, args.device)
        layer_ids = [i for i in LAYER_IDS if i < args.layers - 1] or [0]
        records = synthetic_records(600, torch.Generator().manual_seed(0))
        print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0) if dev.type == 'cuda' else 'CPU'}, "
              f"threads {torch.get_num_threads()}", flush=True)
        for name, extra in (("full recipe", {}), ("no steering", {"steer_anchors": 0.0}),
                            ("no steering, no distillation", {"steer_anchors": 0.0, "distill": 0.0})):
            kw = dict(num_layers=2, block_size=8, target_layer_ids=layer_ids, mask_token_id=16, steps=10**6, lr=3e-4,
                      seqs_per_step=args.seqs, anchors_per_seq=48, gamma=2.0, max_seq_len=640, eval_every=10**6,
                      eval_prompts=0, distill=0.5, steer_anchors=0.5, draft_vocab_size=2048)
            kw.update(extra)
            tr = Trainer(target, target_dir, None, records, TargetFeatures(target, layer_ids), Path(tmp) / "out",
                         TrainConfig(**kw))
            tr.drafter.train()
            warm: dict[str, float] = {}
            for _ in range(args.warmup):
                one_step(tr, warm)
            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            for _ in range(args.steps):
                one_step(tr, timings)
            per = (time.perf_counter() - t0) / args.steps
            print(f"\n== {name}: {per * 1e3:.0f} ms a step of {args.seqs} sequences "
                  f"({args.warmup} warm-up steps {sum(warm.values()):.1f} s)", flush=True)
            for phase, s in timings.items():
                print(f"  {phase:32s} {s / args.steps * 1e3:8.1f} ms")
            if name == "full recipe" and args.profile_steps:
                acts = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                with torch.profiler.profile(activities=acts) as prof:
                    for _ in range(args.profile_steps):
                        one_step(tr, {})
                    sync(dev)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60),
                      flush=True)
                if dev.type == "cuda":
                    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15,
                                                    max_name_column_width=60))


if __name__ == "__main__":
    main()
