"""`generate --threads N` on a quiet machine and beside busy processes: what a CPU user gains by giving the runtime
no more threads than the cores other work leaves free.

Each run is `dflash-trt generate ENGINE --json` in its own process (its decode tok/s, read from the JSON), with
0..B processes spinning in pure Python beside it; the configurations alternate round by round, so drift of the
machine spreads over all of them.

    .venv/bin/python benchmarks/threads_busy.py --engine engines/smollm2-135m-cpu --rounds 3 \
        [--threads 1,2] [--busy 0,1] [--no-spec] [--name threads_busy]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

PROMPT = "Explain how a compiler turns source code into a program, step by step."


def spin() -> None:
    while True:
        pass


def run(engine: str, threads: int, tokens: int, no_spec: bool) -> float:
    cmd = [str(Path(sys.executable).parent / "dflash-trt"), "generate", engine, "--chat", "-p", PROMPT,
           "--max-new-tokens", str(tokens), "--ignore-eos", "--threads", str(threads), "--json"]
    out = subprocess.run(cmd + (["--no-spec"] if no_spec else []), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="engines/smollm2-135m-cpu")
    ap.add_argument("--threads", default="1,2", help="thread counts to compare")
    ap.add_argument("--busy", default="0,1", help="busy processes beside it")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-spec", action="store_true", help="plain decoding (default: the engine's DFlash)")
    ap.add_argument("--name", default="threads_busy")
    args = ap.parse_args()
    threads = [int(x) for x in args.threads.split(",")]
    busy = [int(x) for x in args.busy.split(",")]
    runs: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for b in busy:
            spinners = [mp.Process(target=spin, daemon=True) for _ in range(b)]
            for p in spinners:
                p.start()
            try:
                for t in threads:
                    tok_s = run(args.engine, t, args.tokens, args.no_spec)
                    runs.setdefault(f"busy={b} threads={t}", []).append(round(tok_s, 1))
                    print(f"round {r + 1}: {b} busy, {t} threads: {tok_s:.1f} tok/s", flush=True)
            finally:
                for p in spinners:
                    p.terminate()
                    p.join()
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"{k}: {v} median {medians[k]:.1f} tok/s")
    path = record(args.name, {"engine": args.engine, "prompt": PROMPT, "tokens": args.tokens,
                              "speculative": not args.no_spec, "runs_tok_s": runs, "median_tok_s": medians})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
