"""The roofline model's predicted Pareto points against a measured `bench sweep` of this project's server.

For each run (an AR sweep and a DFlash sweep at one K) and each concurrency c, the model (dflash_trt/perf_model.py,
the calibrated CPU profile) predicts tok/s/user = tau / step_time(c, K) and tok/s/GPU = c x that, with tau taken
from the run's own measured acceptance (1 for AR). Measured figures come from the sweep JSON. The gap includes
what the model leaves out: HTTP/SSE and detokenization, prefill of arriving requests, and the ragged tail of a
point where fewer than c streams are still running. Usage:

    .venv/bin/python benchmarks/perf_model_vs_sweep.py benchmarks/results/peers/ours-ar.json \
        benchmarks/results/peers/ours-dflash.json:3 [--context 100] [--fit amx|avx512_bf16|avx2] [--name NAME]
(RUN.json:K marks a DFlash run at a fixed K; without :K the run is autoregressive. A run whose server changes K
with the batch size (a draft-length schedule, as peers.sh's ours-engine) is not comparable point by point: the
sweep does not record the K of each step, so pass fixed-K runs only. --fit: the CPU profile fit of the machine the
sweep ran on (default: this machine's kind, hardware.cpu_fit). The record goes to benchmarks/results/NAME.json.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from dflash_trt.bench.plot import load_runs  # noqa: E402
from dflash_trt.config import build_config_from_dict  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.hardware import CPU_FITS, cpu_fit, cpu_profile  # noqa: E402
from dflash_trt.models.config import decoder_config_from_dict, read_config_json  # noqa: E402
from dflash_trt.models.dflash import DFlashConfig  # noqa: E402
from dflash_trt.perf_model import PerfModel, predict_pareto  # noqa: E402
from dflash_trt.spec.draft_vocab import load_draft_vocab  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="sweep JSON, optionally :K for a DFlash run")
    ap.add_argument("--context", type=int, default=100, help="mean context length of a decode step (prompt + half the output)")
    ap.add_argument("--fit", choices=sorted(CPU_FITS), help="the CPU fit of the sweep's machine (default: this one's)")
    ap.add_argument("--name", default="perf_model_vs_sweep_cpu", help="the record's name under benchmarks/results/")
    args = ap.parse_args()
    hw = cpu_profile(CPU_FITS[args.fit] if args.fit else cpu_fit())
    target = decoder_config_from_dict(read_config_json(smollm2_dir()))
    drafter = DFlashConfig.from_dict(json.loads((SMOLLM2_DRAFTER / "config.json").read_text()))
    cfg = build_config_from_dict({"name": "cpu", "model": "embedded:smollm2-135m-instruct", "hardware": "cpu",
                                  "dtype": "bfloat16", "max_batch_size": 16, "max_seq_len": 1024,
                                  "speculative_config": {"speculative_model": str(SMOLLM2_DRAFTER)}})
    vocab = load_draft_vocab(SMOLLM2_DRAFTER, target.vocab_size)  # what the served runtime drafts among
    model = PerfModel(target, drafter, cfg, hw, context_len=args.context,
                      draft_vocab_size=None if vocab is None else vocab.numel())
    rows, errors = [], []
    for spec in args.runs:
        path, _, k = spec.partition(":")
        (run,) = load_runs([path])  # tok/s/user as 1 / median TPOT, old result files too
        k = int(k or 0)
        for p in run["points"]:
            if not p.get("tok_s_per_user"):  # no request produced two tokens: nothing to compare
                continue
            c = p["concurrency"]
            tau = (p.get("acceptance") or {}).get("tau") or 1.0 if k else 1.0
            pred = next(q for q in predict_pareto(model, {k: tau} if k else {}, [c], gpus=1) if q.draft_len == k)
            pred_user, pred_total = pred.tok_s_user, pred.tok_s_gpu
            row = {"run": run.get("label") or path, "concurrency": c, "draft_len": k, "tau": round(tau, 3),
                   "measured_tok_s_user": round(p["tok_s_per_user"], 1), "predicted_tok_s_user": round(pred_user, 1),
                   "measured_tok_s_gpu": round(p["tok_s_per_gpu"], 1), "predicted_tok_s_gpu": round(pred_total, 1)}
            row["error_user"] = round(pred_user / p["tok_s_per_user"] - 1, 3)
            row["error_gpu"] = round(pred_total / p["tok_s_per_gpu"] - 1, 3)
            errors += [abs(row["error_user"]), abs(row["error_gpu"])]
            rows.append(row)
            print(f"{row['run']:<24} c={c:<3} K={k}  tok/s/user {row['measured_tok_s_user']:6.1f} measured "
                  f"{row['predicted_tok_s_user']:6.1f} predicted ({row['error_user']:+.0%})   tok/s/GPU "
                  f"{row['measured_tok_s_gpu']:6.1f} measured {row['predicted_tok_s_gpu']:6.1f} predicted ({row['error_gpu']:+.0%})")
    mean = sum(errors) / len(errors)
    print(f"mean |error| {mean:.1%}")
    path = record(args.name, {"command": "benchmarks/perf_model_vs_sweep.py " + " ".join(sys.argv[1:]),
                              "profile": hw.perf_source, "context_len": args.context,
                              "points": rows, "mean_abs_relative_error": mean})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
