"""GPU check and timing of the dflash kernels (one prepared script for a CUDA machine, < 5 minutes).

1. correctness: the Triton kernels == their torch references (draft attention at both drafter shapes,
   with windows and sinks; verify_block with greedy / match / rejection rows);
2. draft attention time vs the torch reference and, if installed, flash-attn (`flash_attn_with_kvcache`,
   what TensorRT-LLM's VANILLA backend runs) and FlashInfer (batch prefill over a paged cache), at the
   drafter shapes of gpt-oss-120b (64 q / 8 kv heads, head_dim 64, block 10) and Qwen3-8B (32 / 8,
   128, block 16), batch 1..256, context 1k..32k, bf16;
3. the fused greedy verify (argmax + prefix + bonus) at batch 256, K = 15, vocabulary 201,088: achieved
   bandwidth against a measured device-to-device copy;
4. the target's masked attention (layers/attention.py `attend`: K/V repeated per query head, so SDPA keeps its
   efficient kernel) against SDPA given the mask with GQA as it is (its math kernel), at Qwen3-8B's heads: a
   prefill chunk and chain verify steps.

    python benchmarks/gpu_kernels.py [--quick] [--out NAME]   (writes benchmarks/results/NAME.json; default gpu_kernels_<gpu>)

Prints a table and writes JSON. Timings are medians of triton.testing.do_bench after warmup.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import record  # noqa: E402

MODELS = {  # name: (q heads, kv heads, head_dim, draft_block_size)
    "gpt-oss-120b": (64, 8, 64, 10),
    "qwen3-8b": (32, 8, 128, 16),
}
BATCHES = (1, 16, 64, 256)
CONTEXTS = (1024, 8192, 32768)
MAX_CACHE_BYTES = 40 << 30  # skip (batch, context) cells whose K+V cache alone exceeds this
REF_MAX_TOKENS = 1 << 20  # the torch reference gathers and masks the whole context: time it up to this size


def bench(fn, rep_ms: int = 60) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))  # ms


def _attention_inputs(b, ctx, h, kvh, d, n, dtype=torch.bfloat16, ragged=False):
    dev = "cuda"
    cache = torch.randn(2, b, ctx + n, kvh, d, device=dev, dtype=dtype)  # NHD: [K/V, slots, S, kv heads, D]
    q = torch.randn(b, n, h, d, device=dev, dtype=dtype)
    kb = torch.randn(b, n, kvh, d, device=dev, dtype=dtype)
    vb = torch.randn(b, n, kvh, d, device=dev, dtype=dtype)
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    if ragged:
        lens = torch.randint(1, ctx + 1, (b,), device=dev, dtype=torch.int32)
    rows = torch.arange(b, device=dev)
    return q, kb, vb, cache[0], cache[1], rows, lens


def check_correctness() -> list[dict]:
    from dflash_trt.kernels.draft_attention import draft_attention_ref
    from dflash_trt.kernels.draft_attention_triton import draft_attention_triton

    out = []
    for name, (h, kvh, d, n) in MODELS.items():
        for causal, window, sinks in [(False, 0, False), (True, 128, True), (False, 64, False)]:
            for splits in (None, 1):
                q, kb, vb, kc, vc, rows, lens = _attention_inputs(4, 3000, h, kvh, d, n, ragged=True)
                s = torch.randn(h, device="cuda") if sinks else None
                # the kernel reads the NHD cache through a [R, KVH, S, D] view
                got = draft_attention_triton(q, kb, vb, kc.transpose(1, 2), vc.transpose(1, 2), rows, lens, d**-0.5,
                                             causal, window, s, num_splits=splits)
                want = draft_attention_ref(q.float(), kb.float(), vb.float(), kc.transpose(1, 2).float(),
                                           vc.transpose(1, 2).float(), rows, lens, d**-0.5, causal, window, s)
                err = (got.float() - want).abs().max().item()
                out.append({"check": "draft_attention", "model": name, "causal": causal, "window": window,
                            "sinks": sinks, "splits": splits, "max_abs_err": err, "ok": err < 2e-2})
    from dflash_trt.kernels.verify_block import GREEDY, MATCH, REJECTION, verify_block_ref
    from dflash_trt.kernels.verify_block_triton import verify_block_triton
    from dflash_trt.layers.sampler import sampling_probs

    g = torch.Generator(device="cuda").manual_seed(0)
    b, k, v = 64, 7, 32000
    logits = torch.randn(b, k + 1, v, device="cuda", generator=g) * 3
    modes = torch.tensor([GREEDY, MATCH, REJECTION], device="cuda").repeat(b // 3 + 1)[:b]
    t = torch.where(modes == GREEDY, 0.0, 0.8)
    top_k = torch.zeros(b, dtype=torch.long, device="cuda")
    top_p = torch.ones(b, device="cuda")
    dprobs = sampling_probs(torch.randn(b, k, v, device="cuda", generator=g) * 3, t.clamp_min(0.8), top_k, top_p)
    drafts = torch.where(torch.rand(b, k, device="cuda", generator=g) < 0.8, logits[:, :k].argmax(-1),
                         dprobs.argmax(-1))
    u = torch.rand(b, k + 1, device="cuda", generator=g)
    args = (drafts, logits, dprobs, u, modes, t, top_k, top_p)
    got = verify_block_triton(*args)
    want = verify_block_ref(*args)
    # GPU float32 cumsums differ from the kernel's float64 ones within rounding: count disagreements
    n_acc = int((got[0] != want[0]).sum())
    n_bonus = int((got[1] != want[1]).sum())
    out.append({"check": "verify_block", "rows": b, "num_accepted_mismatches": n_acc, "bonus_mismatches": n_bonus,
                "ok": n_acc == 0 and n_bonus <= 1})
    return out


def _flash_attn(q, kb, vb, kc, vc, rows, lens, scale):
    from flash_attn import flash_attn_with_kvcache

    def run():
        # appends the block K/V at cache_seqlens, then attends over [context ; block], as TRT-LLM VANILLA does
        return flash_attn_with_kvcache(q, kc, vc, k=kb, v=vb, cache_seqlens=lens, cache_batch_idx=rows.to(torch.int32),
                                       softmax_scale=scale, causal=False)

    return run


def _flashinfer(q, kb, vb, kc, vc, rows, lens, scale):
    import flashinfer

    b, n, h, d = q.shape
    kvh = kb.shape[2]
    page = 16
    total = int(lens.max()) + n
    pages_per_row = (total + page - 1) // page
    kv = torch.randn(b * pages_per_row, 2, page, kvh, d, device="cuda", dtype=q.dtype)  # block K/V already appended
    seq = (lens + n).to(torch.int32)
    indptr = torch.arange(0, (b + 1) * pages_per_row, pages_per_row, device="cuda", dtype=torch.int32)
    indices = torch.arange(b * pages_per_row, device="cuda", dtype=torch.int32)
    last = ((seq - 1) % page + 1).to(torch.int32)
    qo_indptr = torch.arange(0, (b + 1) * n, n, device="cuda", dtype=torch.int32)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    wrapper.plan(qo_indptr, indptr, indices, last, h, kvh, d, page, causal=False, sm_scale=scale,
                 q_data_type=q.dtype, kv_data_type=q.dtype)
    q_flat = q.reshape(b * n, h, d)
    return lambda: wrapper.run(q_flat, kv)


def time_attention(quick: bool) -> list[dict]:
    from dflash_trt.kernels.draft_attention import draft_attention_ref
    from dflash_trt.kernels.draft_attention_triton import draft_attention_triton

    rows_out = []
    batches = (1, 64) if quick else BATCHES
    contexts = (1024, 8192) if quick else CONTEXTS
    for name, (h, kvh, d, n) in MODELS.items():
        for b in batches:
            for ctx in contexts:
                cache_bytes = 2 * b * (ctx + n) * kvh * d * 2
                if cache_bytes > MAX_CACHE_BYTES:
                    continue
                q, kb, vb, kc, vc, rows, lens = _attention_inputs(b, ctx, h, kvh, d, n)
                scale = d**-0.5
                kc_hnd, vc_hnd = kc.transpose(1, 2), vc.transpose(1, 2)
                row = {"model": name, "batch": b, "context": ctx, "q_heads": h, "kv_heads": kvh, "head_dim": d,
                       "block": n, "kv_bytes": cache_bytes}
                row["triton_ms"] = bench(lambda: draft_attention_triton(q, kb, vb, kc_hnd, vc_hnd, rows, lens, scale))
                row["triton_GBps"] = cache_bytes / row["triton_ms"] / 1e6
                if b * ctx <= REF_MAX_TOKENS:
                    row["torch_ref_ms"] = bench(lambda: draft_attention_ref(q, kb, vb, kc_hnd, vc_hnd, rows, lens, scale))
                for label, make in (("flash_attn", _flash_attn), ("flashinfer", _flashinfer)):
                    try:
                        fn = make(q, kb, vb, kc, vc, rows, lens, scale)
                        row[f"{label}_ms"] = bench(fn)
                    except ImportError:
                        row[f"{label}_ms"] = None
                    except Exception as error:  # record and go on: one failing baseline must not sink the run
                        row[f"{label}_error"] = f"{type(error).__name__}: {error}"[:200]
                best = [row.get(x) for x in ("flash_attn_ms", "flashinfer_ms") if row.get(x)]
                row["triton_vs_best_baseline"] = row["triton_ms"] / min(best) if best else None
                rows_out.append(row)
                print(_fmt_attention(row), flush=True)
                # every name holding this cell's caches (FlashInfer's closure keeps its own copy): the next cell's
                # 34 GB would otherwise meet them and OOM
                fn = None
                del q, kb, vb, kc, vc, kc_hnd, vc_hnd
                torch.cuda.empty_cache()
    return rows_out


def _fmt_attention(r: dict) -> str:
    def ms(key):
        v = r.get(key)
        return f"{v:9.3f}" if isinstance(v, float) else f"{'-':>9}"

    ratio = r["triton_vs_best_baseline"]
    return (f"{r['model']:<13} B={r['batch']:<4} ctx={r['context']:<6} triton {ms('triton_ms')} ms "
            f"({r['triton_GBps']:7.0f} GB/s)  ref {ms('torch_ref_ms')}  flash-attn {ms('flash_attn_ms')}  "
            f"flashinfer {ms('flashinfer_ms')}  triton/best {'-' if ratio is None else f'{ratio:.2f}x'}")


def time_verify() -> list[dict]:
    from dflash_trt.kernels.verify_block import GREEDY
    from dflash_trt.kernels.verify_block_triton import verify_block_triton
    from dflash_trt.spec.verifier import verify_greedy

    b, k, v = 256, 15, 201_088
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(b, k + 1, v, device="cuda", dtype=dtype)
        drafts = logits[:, :k].argmax(-1)
        zeros = torch.zeros(b, device="cuda")
        args = (drafts, logits, None, torch.zeros(b, k + 1, device="cuda"), torch.full((b,), GREEDY, device="cuda"),
                zeros, zeros.long(), zeros + 1)
        nbytes = logits.numel() * logits.element_size()
        t_kernel = bench(lambda: verify_block_triton(*args), rep_ms=200)
        t_ref = bench(lambda: verify_greedy(drafts, logits), rep_ms=200)
        t_copy = bench(lambda: logits.clone(), rep_ms=200)  # reads + writes nbytes
        row = {"batch": b, "K": k, "vocab": v, "dtype": str(dtype).removeprefix("torch."), "logits_bytes": nbytes,
               "triton_ms": t_kernel, "torch_argmax_ms": t_ref, "copy_ms": t_copy,
               "triton_GBps": nbytes / t_kernel / 1e6, "copy_GBps": 2 * nbytes / t_copy / 1e6}
        row["fraction_of_copy_bandwidth"] = row["triton_GBps"] / row["copy_GBps"]
        out.append(row)
        print(f"verify greedy B={b} K={k} V={v} {row['dtype']}: triton {t_kernel:.3f} ms = {row['triton_GBps']:.0f} GB/s "
              f"({100 * row['fraction_of_copy_bandwidth']:.0f}% of copy {row['copy_GBps']:.0f} GB/s); "
              f"torch argmax+prefix {t_ref:.3f} ms", flush=True)
        del logits
    return out


def time_masked_attention() -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from dflash_trt.layers.attention import CUDA_SDPA_BACKENDS, attend

    h, kvh, d = 32, 8, 128  # Qwen3-8B
    out = []
    for what, b, n, t in (("prefill chunk", 1, 512, 4096), ("chain verify K=7", 16, 8, 8192),
                          ("chain verify K=15", 64, 16, 2048)):
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, kvh, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.randint(t // 2, t - n + 1, (b,), device="cuda")  # ragged rows: a mask is needed
        pos = lens[:, None] + torch.arange(n, device="cuda")
        mask = (torch.arange(t, device="cuda")[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, Q, T]

        def as_is():
            with sdpa_kernel(CUDA_SDPA_BACKENDS):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True)

        want = as_is().transpose(1, 2).reshape(b, n, h * d)
        got = attend(q, k, v, mask, d**-0.5)
        row = {"what": what, "batch": b, "queries": n, "keys": t, "q_heads": h, "kv_heads": kvh, "head_dim": d,
               "max_abs_diff": float((got.float() - want.float()).abs().max()),
               "attend_ms": bench(lambda: attend(q, k, v, mask, d**-0.5)), "sdpa_gqa_mask_ms": bench(as_is)}
        row["speedup"] = row["sdpa_gqa_mask_ms"] / row["attend_ms"]
        out.append(row)
        print(f"masked attention, {what}: B={b} Q={n} T={t}: attend {row['attend_ms']:.3f} ms, SDPA with GQA and the "
              f"mask {row['sdpa_gqa_mask_ms']:.3f} ms ({row['speedup']:.2f}x), max diff {row['max_abs_diff']:.2e}",
              flush=True)
        del q, k, v, mask
        torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller sweep (batches 1, 64; contexts 1k, 8k)")
    parser.add_argument("--out", default=None, help="result name under benchmarks/results (default gpu_kernels_<gpu>)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernels.py needs a CUDA GPU (the CPU checks live in tests/kernels)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    checks = check_correctness()
    for c in checks:
        print("check", json.dumps(c))
    attention = time_attention(args.quick)
    verify = time_verify()
    masked = time_masked_attention()
    name = args.out or "gpu_kernels_" + gpu.lower().replace(" ", "_").replace("nvidia_", "")
    path = record(name, {"gpu": gpu, "checks": checks, "draft_attention": attention, "verify_greedy": verify,
                         "masked_attention": masked, "wall_s": time.perf_counter() - start,
                         "command": " ".join(sys.argv)})
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
