"""Qwen3.5 (hybrid) speed on this CPU against a Qwen3 of the same widths: random weights (hidden 768, 8 layers: the
Qwen3.5 six gated delta rule layers and two full attention ones, 8/2 heads of 128, linear heads 8 key / 16 value of
64, MLP 2048, vocab 32,000), bf16, batch 1, greedy, a prompt of 200 tokens:

(a) transformers `generate` on the Qwen3.5 (its reference PyTorch delta rule); (b) this runtime, --no-spec; (c) this
runtime with a random drafter and forced acceptance (drafts replaced by the true greedy continuation) at K = 3 and 7:
tau = K + 1, what a verify step of K + 1 tokens costs against a one-token step when every draft is used. The Qwen3
runs (b) and (c) too: the hybrid takes a verify block's tokens through its delta rule one by one, attention layers
take them at once. Interleaved rounds, medians reported.

    .venv/bin/python benchmarks/bench_qwen3_5.py [--new-tokens 64] [--rounds 3] [--name qwen3_5_cpu]
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
from bench_gpt_oss import force_acceptance  # noqa: E402
from common import record  # noqa: E402

from dflash_trt import SamplingParams  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.models.dflash import DFlashConfig, load_drafter, new_drafter, save_drafter  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402

COMMON = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, eos_token_id=0, bos_token_id=1,
              tie_word_embeddings=False)
HYBRID = dict(linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64)
KS = (3, 7)


def random_target(out: Path, hybrid: bool) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON, **HYBRID)) if hybrid else \
        Qwen3ForCausalLM(Qwen3Config(**COMMON))
    model.eval().save_pretrained(out)
    return out


def random_drafter(out: Path) -> Path:
    cfg = DFlashConfig(hidden_size=768, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                       intermediate_size=2048, block_size=max(KS) + 1, mask_token_id=31999, target_layer_ids=[1, 4, 6],
                       vocab_size=32000, num_target_layers=8, max_position_embeddings=4096)
    return save_drafter(new_drafter(cfg, seed=0), out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="qwen3_5_cpu", help="the record's name under benchmarks/results/")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import Qwen3_5ForCausalLM

    tmp = Path(tempfile.mkdtemp())
    ddir = random_drafter(tmp / "drafter")
    dirs = {"qwen3_5": random_target(tmp / "qwen3_5", True), "qwen3": random_target(tmp / "qwen3", False)}
    # prefix_reuse off for both: each would otherwise take the repeated prompt over from its last run, and its
    # prefill would time nothing
    dtype, cfg = torch.bfloat16, dict(max_batch_size=1, dtype="bfloat16", max_model_len=512, prefix_reuse=False)
    engines = {}
    for family, d in dirs.items():
        target = load_target(d, dtype)
        drafter = load_drafter(ddir, target.config, dtype)
        engines[(family, 0)] = LLMEngine(target, None, None, EngineConfig(speculative=False, **cfg))
        for k in KS:
            engines[(family, k)] = LLMEngine(target, None, drafter, EngineConfig(max_draft_len=k, **cfg))
    hf = Qwen3_5ForCausalLM.from_pretrained(dirs["qwen3_5"], dtype=dtype).eval()
    prompt = torch.randint(2, 31999, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    n = args.new_tokens
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    truth = {f: prompt + engines[(f, 0)].generate([prompt], params)[0].token_ids for f in dirs}

    def run(key):
        if key[1]:
            force_acceptance(engines[key], truth[key[0]])
        out = engines[key].generate([prompt], params)[0]
        steps = len(out.acceptance_lengths) if key[1] else n - 1
        return out, out.decode_time / steps * 1000

    def run_hf():
        with torch.no_grad():
            start = time.perf_counter()
            hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return n / (time.perf_counter() - start)

    for key in engines:  # warm up every path
        run(key)
    run_hf()
    samples: dict[str, list[float]] = {}
    same = True
    for _ in range(args.rounds):
        samples.setdefault("a_hf_qwen3_5_tok_s_e2e", []).append(run_hf())
        for (family, k) in engines:
            out, step_ms = run((family, k))
            same &= out.token_ids == truth[family][len(prompt):]
            samples.setdefault(f"{family}_k{k}_decode_tok_s", []).append(out.tokens_per_s)
            samples.setdefault(f"{family}_k{k}_step_ms", []).append(step_ms)
            samples.setdefault(f"{family}_k{k}_prefill_ms", []).append(out.prefill_time * 1000)
    med = {key: round(statistics.median(v), 3) for key, v in samples.items()}
    ratios = {f"{f}_k{k}_step_over_plain_step": round(med[f"{f}_k{k}_step_ms"] / med[f"{f}_k0_step_ms"], 3)
              for f in dirs for k in KS}
    ratios |= {f"{f}_k{k}_forced_decode_speedup": round(med[f"{f}_k{k}_decode_tok_s"] / med[f"{f}_k0_decode_tok_s"], 3)
               for f in dirs for k in KS}
    path = record(args.name, {
        "command": " ".join(sys.argv), "shapes": {"common": COMMON, "hybrid": HYBRID}, "dtype": "bfloat16",
        "prompt_len": len(prompt), "new_tokens": n, "rounds": args.rounds, "ks": list(KS),
        "drafter": "random, 1 layer, block 8, forced to the true greedy continuation (tau = K + 1)",
        "speculative_output_equals_plain_output": same, "median": med, "ratios": ratios, "samples": samples})
    for key, v in {**med, **ratios}.items():
        print(f"{key:40s} {v:9.3f}")
    print(f"speculative output == plain output: {same}; recorded {path}")


if __name__ == "__main__":
    main()
