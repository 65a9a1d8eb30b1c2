"""Runtime speed on the CPU default (SmolLM2-135M-Instruct), same prompts, same dtype, greedy:

(a) transformers `generate`; (b) this runtime, --no-spec; (c) this runtime, speculative with a random
drafter at K=7 (the cost of speculation when nothing is accepted); (d) z-lab's `dflash_generate` with the
same drafter. Interleaved rounds, medians reported. Usage:

    .venv/bin/python benchmarks/bench_runtime.py [--new-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CHAT_PROMPTS, chat_ids, record  # noqa: E402

from dflash_trt import SamplingParams  # noqa: E402
from dflash_trt.embedded import smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.models.dflash import DFlashConfig, build_target_layer_ids, load_drafter, new_drafter, save_drafter  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402


def random_drafter(out: Path, layers: int = 2, block_size: int = 16) -> Path:
    cfg = DFlashConfig(hidden_size=576, num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       intermediate_size=1536, block_size=block_size, mask_token_id=16,
                       target_layer_ids=build_target_layer_ids(30, 5), vocab_size=49152, num_target_layers=30,
                       rope={"rope_type": "default", "rope_theta": 100000.0}, max_position_embeddings=8192)
    return save_drafter(new_drafter(cfg, seed=0), out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-k", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tdir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(tdir)
    ddir = random_drafter(Path(tempfile.mkdtemp()) / "drafter")
    dtype = torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(tdir, dtype=dtype).eval()
    zd = DFlashDraftModel.from_pretrained(ddir, dtype=dtype).eval()
    target = load_target(tdir, dtype)
    drafter = load_drafter(ddir, target.config, dtype)
    cfg = dict(max_batch_size=1, dtype="bfloat16")
    ar = LLMEngine(target, tok, None, EngineConfig(speculative=False, **cfg))
    spec = LLMEngine(target, tok, drafter, EngineConfig(max_draft_len=args.k, **cfg))
    prompts = [chat_ids(tok, p) for p in CHAT_PROMPTS]
    n = args.new_tokens
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)

    def run_hf(p, new):
        with torch.no_grad():
            t = time.perf_counter()
            hf.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
            return time.perf_counter() - t

    def run_zlab(p):
        t = time.perf_counter()
        dflash_generate(zd, hf, torch.tensor([p]), n, None, block_size=args.k + 1)
        return time.perf_counter() - t

    def run_ours(engine, p):
        t = time.perf_counter()
        out = engine.generate([p], params)[0]
        return time.perf_counter() - t, out

    # Warm up every path and shape class (compile, first-call allocations).
    for p in prompts[:2]:
        run_hf(p, 8), run_zlab(p), run_ours(ar, p), run_ours(spec, p)

    rows = {k: [] for k in ("a_hf_e2e", "a_hf_decode", "b_ours_ar_e2e", "b_ours_ar_decode", "c_ours_spec_e2e",
                            "c_ours_spec_decode", "d_zlab_e2e", "ar_step_ms", "spec_step_ms", "tau")}
    for _ in range(args.rounds):
        for p in prompts:
            full, one = run_hf(p, n), run_hf(p, 1)
            rows["a_hf_e2e"].append(n / full)
            rows["a_hf_decode"].append((n - 1) / (full - one))
            wall, out = run_ours(ar, p)
            rows["b_ours_ar_e2e"].append(n / wall)
            rows["b_ours_ar_decode"].append(out.tokens_per_s)
            rows["ar_step_ms"].append(out.decode_time / (n - 1) * 1000)
            wall, out = run_ours(spec, p)
            rows["c_ours_spec_e2e"].append(n / wall)
            rows["c_ours_spec_decode"].append(out.tokens_per_s)
            rows["spec_step_ms"].append(out.decode_time / len(out.acceptance_lengths) * 1000)
            rows["tau"].append(out.tau)
            rows["d_zlab_e2e"].append(n / run_zlab(p))
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratios = {
        "b_over_a_e2e": med["b_ours_ar_e2e"] / med["a_hf_e2e"],
        "b_over_a_decode": med["b_ours_ar_decode"] / med["a_hf_decode"],
        "spec_step_over_ar_step": med["spec_step_ms"] / med["ar_step_ms"],
        "c_over_d_e2e": med["c_ours_spec_e2e"] / med["d_zlab_e2e"],
    }
    name = "runtime_smollm2_cpu"
    path = record(name, {"command": " ".join(sys.argv), "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized)",
                         "dtype": "bfloat16", "new_tokens": n, "k": args.k, "rounds": args.rounds,
                         "drafter": "random, 2 layers, block 16, 5 target features", "median": med, "ratios": ratios,
                         "samples": rows})
    for k, v in {**med, **ratios}.items():
        print(f"{k:24s} {v:8.3f}")
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
