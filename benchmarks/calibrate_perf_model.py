"""Calibrate the CPU profile of the roofline step-time model (dflash_trt/perf_model.py) against this runtime.

Measures the wall time of one engine step of this project's runtime on SmolLM2-135M-Instruct (bf16, 2
threads) with a random drafter (block 16, so tau ~ 1: the step cost alone) that drafts among the shipped
drafter's draft vocabulary (its draft_vocab.json: the per-row head and argmax costs the runtime really pays, which
the fitted draft overhead would otherwise carry for the whole vocabulary) at batch 1, 2, 4, 8, 16 and K = 0, 3, 7;
fits the CPU profile's memory bandwidth, FLOP/s, per-step and per-draft overheads by least squares on the
relative error (grid over bandwidth and FLOP/s, linear least squares for the overheads); and records predicted
against measured per point, plus the draft-length schedule that the measured and the modelled step times each
choose with the shipped drafter's measured tau (benchmarks/README.md).
Each point is fitted at its fastest step (contention only adds time) and recorded with its median. Run
it on a quiet machine (load average below 2): the record keeps the load average before and after, and
marks the fit unusable ("valid": false) when a point's median step exceeds 1.5x its fastest, the sign
of another process taking the cores. Sized to run in under 3 minutes. Usage:

    .venv/bin/python benchmarks/calibrate_perf_model.py [--steps 8] [--rounds 1] [--name NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import random_drafter  # noqa: E402
from common import record  # noqa: E402

from dflash_trt import SamplingParams  # noqa: E402
from dflash_trt.config import build_config_from_dict  # noqa: E402
from dflash_trt.draft_schedule import choose_draft_len_schedule  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.hardware import has_amx_tiles, profile  # noqa: E402
from dflash_trt.models.dflash import load_drafter  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402
from dflash_trt.perf_model import PerfModel  # noqa: E402
from dflash_trt.spec.draft_vocab import FILE as DRAFT_VOCAB_FILE  # noqa: E402

BATCHES = (1, 2, 4, 8, 16)
KS = (0, 3, 7)
PROMPT_LEN = 64
# The shipped drafter's held-out tau, bf16 (bench_drafter.py, record drafter_smollm2_cpu_s13_new.json; its model card).
SHIPPED_TAU = {3: 1.84, 7: 1.95}


def measure(engine: LLMEngine, batch: int, k: int, steps: int, warmup: int = 2) -> dict:
    """Median wall time of `steps` decode steps of `batch` rows at K (all rows prefilled, none finishing)."""
    g = torch.Generator().manual_seed(batch * 100 + k)
    seqs = [engine.add_request(torch.randint(100, 40000, (PROMPT_LEN,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=400, ignore_eos=True)) for _ in range(batch)]
    while any(not s.is_prefilled for s in seqs):
        engine.step()
    times, contexts = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        r = engine.step()
        dt = time.perf_counter() - t0
        assert len(r.batch.decodes) == batch and not r.batch.prefills and r.batch.num_draft == k, "unexpected step"
        if i >= warmup:
            times.append(dt)
            contexts.append(statistics.mean(s.num_cached for s in seqs))
    for s in seqs:
        engine.abort(s.request_id)
    while engine.has_unfinished():
        engine.step()
    return {"batch_size": batch, "draft_len": k, "context_len": round(statistics.mean(contexts)),
            "measured_s": min(times), "median_s": statistics.median(times), "steps": len(times)}


def measure_ceilings(repeats: int = 5) -> dict:
    """This machine's raw roofline ceilings for the record: copy bandwidth (bytes read + written per second,
    256 MB) and bf16 GEMM FLOP/s (2048^3), best of `repeats`. The fit below does not use them: the runtime's
    small GEMMs reach a fraction of either, and weight bytes do not change with the batch, so bandwidth and
    fixed overhead are not separately identifiable from step times; the fitted values are effective ones."""
    src = torch.ones(64 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, dtype=torch.bfloat16)
    best_copy, best_mm = float("inf"), float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t)
        t = time.perf_counter()
        torch.mm(a, b)
        best_mm = min(best_mm, time.perf_counter() - t)
    return {"copy_bytes_s": 2 * src.numel() * src.element_size() / best_copy, "bf16_gemm_flops": 2 * 2048**3 / best_mm}


def fit(model: PerfModel, points: list[dict]) -> dict:
    """Bandwidth, FLOP/s, step and draft overheads minimising the squared relative error of the prediction."""
    hw0 = dataclasses.replace(model.hw, step_overhead_s=0.0, layer_overhead_s=0.0, draft_overhead_s=0.0)
    m0 = dataclasses.replace(model, hw=hw0)
    costs = [(m0.target_cost(p["batch_size"], p["draft_len"] + 1, p["context_len"]),
              m0.drafter_cost(p["batch_size"], p["draft_len"], p["context_len"])) for p in points]
    tb, tf = (np.array([getattr(c[0], a) for c in costs]) for a in ("bytes", "flops"))
    db, df = (np.array([getattr(c[1], a) for c in costs]) for a in ("bytes", "flops"))
    spec = np.array([p["draft_len"] > 0 for p in points], dtype=float)
    measured = np.array([p["measured_s"] for p in points])
    w = 1.0 / measured  # relative error

    def solve(bw, fl):
        roof = np.maximum(tb / bw, tf / fl) + spec * np.maximum(db / bw, df / fl)
        a = np.stack([np.ones_like(spec), spec], 1) * w[:, None]
        y = (measured - roof) * w
        coef = np.linalg.lstsq(a, y, rcond=None)[0]
        if coef[1] < 0:  # overheads are costs: clip at 0 and refit the other
            coef = np.array([max(0.0, float(np.sum(a[:, 0] * y) / np.sum(a[:, 0] ** 2))), 0.0])
        if coef[0] < 0:
            coef = np.array([0.0, max(0.0, float(np.sum(a[:, 1] * y) / np.sum(a[:, 1] ** 2)))])
        err = float(np.sum((a @ coef - y) ** 2))
        return err, coef

    best = None
    for lo_bw, hi_bw, lo_f, hi_f, n in ((8.0, 12.0, 9.0, 13.0, 81), (None, None, None, None, 41)):
        if lo_bw is None:  # refine around the coarse optimum, a factor of 2 either way
            lo_bw, hi_bw = np.log10(best[1]) - 0.3, np.log10(best[1]) + 0.3
            lo_f, hi_f = np.log10(best[2]) - 0.3, np.log10(best[2]) + 0.3
        for bw in np.logspace(lo_bw, hi_bw, n):
            for fl in np.logspace(lo_f, hi_f, n):
                err, coef = solve(bw, fl)
                if best is None or err < best[0]:
                    best = (err, float(bw), float(fl), coef)
    _, bw, fl, coef = best
    return {"mem_bandwidth_bytes_s": bw, "dense_flops": fl, "step_overhead_s": float(coef[0]),
            "draft_overhead_s": float(coef[1]), "layer_overhead_s": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--name", default=None, help="record name (benchmarks/results/NAME.json; default: the record of "
                    "this CPU's kind, perf_model_cpu with AMX tiles, perf_model_cpu_avx2 without)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    started, load_before = time.time(), os.getloadavg()
    if load_before[0] > 2:
        print(f"warning: load average {load_before[0]:.1f}; step times will include other processes' work")
    tdir = smollm2_dir()
    ddir = random_drafter(Path(tempfile.mkdtemp()) / "drafter")
    shutil.copy(SMOLLM2_DRAFTER / DRAFT_VOCAB_FILE, ddir / DRAFT_VOCAB_FILE)
    target = load_target(tdir, torch.bfloat16)
    drafter = load_drafter(ddir, target.config, torch.bfloat16)
    engines = {k: LLMEngine(target, None, drafter if k else None,
                            EngineConfig(max_batch_size=max(BATCHES), max_model_len=512, max_draft_len=k or None,
                                         speculative=k > 0, dtype="bfloat16")) for k in KS}
    for engine in engines.values():  # the step's cost at every K, past the rows the engine keeps exact by default
        engine.exact_rows = None
    runs: dict[tuple[int, int], list[dict]] = {}
    for _ in range(args.rounds):
        for b in BATCHES:
            for k in KS:  # interleaved, so drifting machine load touches every K alike
                runs.setdefault((b, k), []).append(measure(engines[k], b, k, args.steps))
    points = [min(rs, key=lambda r: r["measured_s"]) for rs in runs.values()]

    cfg = build_config_from_dict({"name": "calibration", "model": "embedded:smollm2-135m-instruct", "hardware": "cpu",
                                  "dtype": "bfloat16", "max_batch_size": max(BATCHES), "max_seq_len": 512,
                                  "speculative_config": {"speculative_model": str(ddir)}})
    model = PerfModel(target.config, drafter.config, cfg, profile("cpu"), context_len=PROMPT_LEN,
                      draft_vocab_size=drafter.draft_vocab.numel())
    fitted = fit(model, points)
    calibrated = dataclasses.replace(model, hw=dataclasses.replace(model.hw, **fitted))
    for p in points:
        p["predicted_s"] = calibrated.step_time(p["batch_size"], p["draft_len"], p["context_len"])
        p["relative_error"] = p["predicted_s"] / p["measured_s"] - 1
        p["predicted_breakdown"] = calibrated.breakdown(p["batch_size"], p["draft_len"], p["context_len"])
    errors = [abs(p["relative_error"]) for p in points]
    noisy = [(p["batch_size"], p["draft_len"]) for p in points if p["median_s"] > 1.5 * p["measured_s"]]
    measured = {(p["batch_size"], p["draft_len"]): p["measured_s"] for p in points}
    predicted = {(p["batch_size"], p["draft_len"]): p["predicted_s"] for p in points}
    decision = {
        "tau_by_draft_len": SHIPPED_TAU,
        "batch_sizes": list(BATCHES),
        "schedule_from_measured_steps": choose_draft_len_schedule(SHIPPED_TAU, lambda b, k: measured[(b, k)],
                                                                  BATCHES, max(KS)),
        "schedule_from_model": choose_draft_len_schedule(SHIPPED_TAU, lambda b, k: predicted[(b, k)], BATCHES, max(KS)),
    }
    name = args.name or ("perf_model_cpu" if has_amx_tiles() else "perf_model_cpu_avx2")
    path = record(name, {
        "command": "benchmarks/calibrate_perf_model.py " + " ".join(sys.argv[1:]),
        "setup": f"SmolLM2-135M-Instruct bf16, torch {torch.__version__}, 2 threads, random drafter (2 layers, "
                 f"block 16, the shipped drafter's {drafter.draft_vocab.numel()}-token draft vocabulary), prompts of "
                 f"{PROMPT_LEN} random tokens, greedy; fastest (measured_s) and median of "
                 f"{args.steps} steps after 2 warm-up steps, best of {args.rounds} round(s)",
        "valid": not noisy,
        "noisy_points": noisy,
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "fitted_profile": fitted,
        "raw_ceilings": measure_ceilings(),
        "mean_abs_relative_error": statistics.mean(errors),
        "max_abs_relative_error": max(errors),
        "points": points,
        "decision": decision,
        "wall_s": round(time.time() - started, 1),
    })
    for p in points:
        print(f"b={p['batch_size']:>2} K={p['draft_len']} L={p['context_len']:>3}  measured {p['measured_s'] * 1e3:7.2f} ms"
              f"  predicted {p['predicted_s'] * 1e3:7.2f} ms  ({p['relative_error']:+.1%})")
    print("fitted:", fitted)
    print("decision:", decision)
    print(f"mean |error| {statistics.mean(errors):.1%}, max {max(errors):.1%}; wrote {path}")
    if noisy:
        print(f"NOT VALID: median step > 1.5x the fastest at (batch, K) {noisy}: rerun on a quiet machine")


if __name__ == "__main__":
    main()
