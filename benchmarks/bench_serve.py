"""Serving throughput vs interactivity through `dflash-trt serve` on the CPU default (SmolLM2-135M, bf16).

Two servers run side by side (speculative and --no-spec, same flags otherwise); each round measures
both at 1, 4 and 16 concurrent streams (that many chat requests at once, greedy, --new-tokens each,
EOS ignored, streamed with the official openai client). Reported per point, as medians over rounds:
output tok/s (all tokens / wall time from the first request to the last token), tok/s per user
(1 / TPOT, averaged over requests) and TTFT p50, as `dflash-trt bench sweep` (dflash_trt/bench/sweep.py)
measures them. For full sweeps against any endpoint use that command (or benchmarks/peers.sh).

Usage: benchmarks/bench_serve.py [--rounds 3] [--new-tokens 64] [-k 7] [--drafter DIR]
Without --drafter (and without drafters/smollm2-135m-dflash) the drafter is random (tau ~ 1), so the
speculative server shows the pure cost of speculation under batching, not its benefit.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import random_drafter  # noqa: E402
from common import CHAT_PROMPTS, record  # noqa: E402

from dflash_trt.bench.datasets import BenchPrompt  # noqa: E402
from dflash_trt.bench.sweep import SweepConfig, run_sweep  # noqa: E402

from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402

CONCURRENCY = (1, 4, 16)
MODEL = "smollm2"
PROMPTS = [BenchPrompt(f"chat/{i}", "chat", text, 64) for i, text in enumerate(CHAT_PROMPTS)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "dflash_trt", "serve", "--port", str(port), "--served-model-name", MODEL,
           "--dtype", "bfloat16", "--max-batch-size", "16", "--max-model-len", "1024", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, f"http://127.0.0.1:{port}/v1"


def wait_up(url: str, proc: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited"
        try:
            if httpx.get(url.removesuffix("/v1") + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def point(url: str, concurrency: int, new_tokens: int, label: str) -> dict:
    """One closed-loop point of `dflash-trt bench sweep` (no warm-up: main() warms every server up first)."""
    cfg = SweepConfig(url=url, model=MODEL, concurrencies=[concurrency], requests_per_concurrency=1,
                      min_requests=concurrency, warmup_requests=0, osl=new_tokens, label=label)
    (p,) = run_sweep(cfg, PROMPTS)["points"]
    return {"output_tok_s": p["output_tok_s"], "tok_s_per_user": p["tok_s_per_user"], "ttft_s": p["ttft_s"]["p50"],
            "tau": (p["acceptance"] or {}).get("tau")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=7)
    ap.add_argument("--drafter", default=None, help="drafter directory (default: the trained one, else a random one)")
    args = ap.parse_args()
    target = smollm2_dir()
    if args.drafter:
        drafter, kind = Path(args.drafter), f"given: {args.drafter}"
    elif (SMOLLM2_DRAFTER / "config.json").is_file():
        drafter, kind = SMOLLM2_DRAFTER, "trained: drafters/smollm2-135m-dflash"
    else:
        drafter, kind = random_drafter(Path(tempfile.mkdtemp()) / "drafter"), "random, 2 layers, block 16 (tau ~ 1)"
    systems = {
        "no-spec": start(["--target", str(target), "--no-spec"]),
        f"dflash K={args.k}": start(["--target", str(target), "--drafter", str(drafter), "-k", str(args.k)]),
    }
    try:
        for proc, url in systems.values():
            wait_up(url, proc)
        for proc, url in systems.values():  # warm-up: every batch size once
            for c in CONCURRENCY:
                point(url, c, 8, "warm-up")
        results: dict = {name: {c: [] for c in CONCURRENCY} for name in systems}
        for _ in range(args.rounds):
            for name, (_, url) in systems.items():
                for c in CONCURRENCY:
                    results[name][c].append(point(url, c, args.new_tokens, name))
    finally:
        for proc, _ in systems.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in systems.values():
            proc.wait(30)
    table = {}
    for name, by_c in results.items():
        for c, runs in by_c.items():
            med = {key: statistics.median(r[key] for r in runs) for key in ("output_tok_s", "tok_s_per_user", "ttft_s")}
            taus = [r["tau"] for r in runs if r["tau"] is not None]
            med["tau"] = statistics.median(taus) if taus else None
            table[f"{name} @ {c}"] = {key: round(v, 3) if v is not None else None for key, v in med.items()}
            print(f"{name:>14} x{c:<3} output {med['output_tok_s']:7.1f} tok/s   per user {med['tok_s_per_user']:6.1f} tok/s"
                  f"   TTFT {med['ttft_s'] * 1000:6.0f} ms" + (f"   tau {med['tau']:.2f}" if med["tau"] else ""))
    path = record("serve_smollm2_cpu", {
        "command": "benchmarks/bench_serve.py " + " ".join(sys.argv[1:]), "model": "SmolLM2-135M-Instruct bf16",
        "drafter": kind, "max_draft_len": args.k, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "concurrency": list(CONCURRENCY), "max_batch_size": 16, "median": table, "runs": {
            name: {str(c): runs for c, runs in by_c.items()} for name, by_c in results.items()},
    })
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
