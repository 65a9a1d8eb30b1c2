"""The roofline model's GPU speedups against the published gpt-oss-120b DFlash figures (no GPU measures it here).

The GPU profiles take published peaks and estimated fixed costs (hardware.py); nothing in this project has timed a
GPU step. The nearest check is the published record of gpt-oss-120b with z-lab's drafter (block 10, K=9;
../shared/reference/dflash.md sections 6.3-6.4):
- the DFlash paper's Table 11: SGLang on B200 at concurrency 8, tau / speedup over autoregressive decoding
  5.4 / 1.6x (MATH-500), 4.4 / 1.7x (HumanEval), 3.7 / 1.3x (MT-Bench);
- NVIDIA's blog (TensorRT-LLM, DGX B300, SPEED-Bench): "more than doubles interactivity" at batch size 1, 2.3x
  on average (concurrency and tau not given).
For each published tau the model's DFlash-over-AR ratio of tok/s/user (tau / step(b, 9) against 1 / step(b, 0)) is
taken at batch 1 and 8 with the latency build config's mapping (TP8, EP8, the B300 profile: the B200 has the same
8 TB/s and BF16 peak). The record goes to benchmarks/results/perf_model_vs_published.json. Usage:

    .venv/bin/python benchmarks/perf_model_vs_published.py [--context 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from dflash_trt.config import load_build_config  # noqa: E402
from dflash_trt.hardware import profile  # noqa: E402
from dflash_trt.model_configs import bundled_config  # noqa: E402
from dflash_trt.models.config import decoder_config_from_dict  # noqa: E402
from dflash_trt.models.dflash import DFlashConfig  # noqa: E402
from dflash_trt.perf_model import PerfModel  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "build_configs" / "gpt-oss-120b-8xb300-latency.yaml"
# (source, dataset, tau, batch, published speedup)
PUBLISHED = [
    ("DFlash paper Table 11 (SGLang, B200)", "MATH-500", 5.4, 8, 1.6),
    ("DFlash paper Table 11 (SGLang, B200)", "HumanEval", 4.4, 8, 1.7),
    ("DFlash paper Table 11 (SGLang, B200)", "MT-Bench", 3.7, 8, 1.3),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024, help="mean context length of a decode step")
    args = ap.parse_args()
    cfg, _ = load_build_config(CONFIG)
    model = PerfModel(decoder_config_from_dict(bundled_config("openai/gpt-oss-120b")),
                      DFlashConfig.from_dict(bundled_config("z-lab/gpt-oss-120b-DFlash"), "z-lab/gpt-oss-120b-DFlash"),
                      cfg, profile("b300"), context_len=args.context)

    def speedup(tau: float, batch: int, k: int = 9) -> float:
        return tau * model.step_time(batch, 0) / model.step_time(batch, k)

    rows = []
    for source, dataset, tau, batch, published in PUBLISHED:
        predicted = {f"batch_{b}": round(speedup(tau, b), 2) for b in (1, batch)}
        rows.append({"source": source, "dataset": dataset, "tau": tau, "published_batch": batch,
                     "published_speedup": published, "predicted_speedup": predicted,
                     "predicted_over_published": round(speedup(tau, batch) / published, 2)})
        print(f"{dataset:9s} tau {tau}: published {published}x at {batch}; predicted "
              + ", ".join(f"{v}x at {k.removeprefix('batch_')}" for k, v in predicted.items()))
    steps = {f"batch_{b}": {"K=0_ms": round(model.step_time(b, 0) * 1e3, 3),
                            "K=9_ms": round(model.step_time(b, 9) * 1e3, 3)} for b in (1, 8)}
    print("predicted steps:", steps)
    path = record("perf_model_vs_published", {
        "config": CONFIG.name, "hardware": "b300", "context_len": args.context, "draft_len": 9,
        "nvidia_blog": "TensorRT-LLM, DGX B300, SPEED-Bench: more than 2x interactivity at batch 1, 2.3x on average "
                       "(tau and concurrency not published)",
        "rows": rows, "predicted_steps": steps})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
