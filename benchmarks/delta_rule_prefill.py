"""A hybrid target's prompt through one linear-attention layer's delta rule: token by token against by chunks
(layers/delta_rule.py), at Qwen3.5-4B's head shapes (32 value heads of 128, keys of 128), fp32 as the runtime runs it.

    .venv/bin/python benchmarks/delta_rule_prefill.py [--tokens 128,512,2048] [--device cpu|cuda] [--name NAME]

Records benchmarks/results/NAME.json: milliseconds per layer for each prompt length, both ways, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import record, require_device
from dflash_trt.layers.delta_rule import delta_rule_chunked, delta_rule_steps


def _inputs(t: int, heads: int, dim: int, device: str):
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, t, heads, dim, generator=g), dim=-1) / dim**0.5
    k = F.normalize(torch.randn(1, t, heads, dim, generator=g), dim=-1)
    v, beta = torch.randn(1, t, heads, dim, generator=g), torch.rand(1, t, heads, generator=g)
    log_decay = -torch.rand(1, t, heads, generator=g)
    state = torch.zeros(1, heads, dim, dim)
    return [x.to(device) for x in (q, k, v, beta, log_decay, state)]


def _ms(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(samples), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,512,2048")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="delta_rule_prefill")
    a = ap.parse_args()
    require_device(a.device, "--device cpu")
    rows = []
    with torch.inference_mode():
        for t in (int(x) for x in a.tokens.split(",")):
            q, k, v, beta, log_decay, state = _inputs(t, a.heads, a.dim, a.device)
            steps = _ms(lambda: delta_rule_steps(q, k, v, beta, log_decay.exp(), state, t - 1), a.device, a.repeats)
            chunks = _ms(lambda: delta_rule_chunked(q, k, v, beta, log_decay, state), a.device, a.repeats)
            rows.append({"tokens": t, "steps_ms": steps, "chunked_ms": chunks, "speedup": round(steps / chunks, 2)})
            print(rows[-1], flush=True)
    print(record(a.name, {"heads": a.heads, "key_dim": a.dim, "value_dim": a.dim, "device": a.device,
                          "rows": rows}))


if __name__ == "__main__":
    main()
