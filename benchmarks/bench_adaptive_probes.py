"""The adaptive draft length's probes: backing off while the decision holds against probing every 16 steps.

An engine with the CPU default's schedule ({1: 2, 2: 2, 4: 1}) and the shipped drafter, 4 rows, 12 cpu-small
prompts x 96 tokens per run (EOS ignored), where plain decoding wins and speculation runs only as probes. Each
controller is first warmed at 4 rows, then the two alternate over interleaved rounds on other prompts; tok/s.

    .venv/bin/python benchmarks/bench_adaptive_probes.py [--rounds 3]
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
from dflash_trt.engine.adaptive_draft import AdaptiveDraftLen  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = EngineConfig(dtype="bfloat16", max_batch_size=4, max_draft_len=3, draft_len_schedule={1: 2, 2: 2, 4: 1},
                       adaptive_draft_len=True)
    engine = LLMEngine.from_dirs(smollm2_dir(), SMOLLM2_DRAFTER, cfg)
    texts = [p.text for p in load_dataset("cpu-small")]
    params = SamplingParams(max_new_tokens=96, ignore_eos=True)
    controllers = {"backoff": AdaptiveDraftLen(), "every_16": AdaptiveDraftLen(max_probe_every=16)}
    for ctl in controllers.values():
        engine.adaptive = ctl
        engine.generate([engine.encode(t, chat=True) for t in texts[:4]], params)
    samples: dict[str, list[float]] = {name: [] for name in controllers}
    run = 0
    for _ in range(args.rounds):
        for name, ctl in controllers.items():
            engine.adaptive, run = ctl, run + 1
            prompts = [engine.encode(texts[(run * 4 + i) % len(texts)], chat=True) for i in range(12)]
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            samples[name].append(sum(o.num_tokens for o in outs) / (time.perf_counter() - start))
    result = {name: {"tok_s_median": round(statistics.median(s), 1), "tok_s": [round(x, 1) for x in s]}
              for name, s in samples.items()}
    print(result)
    print(f"recorded {record('adaptive_probes_cpu', {'command': ' '.join(sys.argv), 'rows': 4, 'results': result})}")


if __name__ == "__main__":
    main()
