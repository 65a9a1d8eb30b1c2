"""Decoding a sliding-window target on the CPU past its window: the C kernels with windows (session 48) against
torch's attention, which took every step once the context passed the window before (the kernels as dd4980c~1 ran
them, restored in this process for the "before" rounds: only while every key lies within the window).

A random Mistral of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads over 3 KV heads) with a window of 128,
bf16, one row, greedy, a prompt of 160 tokens: every step decodes past the window. Plain decoding and a K=3 chain
over a random drafter (its drafts rejected: the cost of a verify step of 4 rows), decode tokens/s (the prompt's
prefill timed apart); interleaved rounds, medians and the ratio of each round's pair reported. Usage:

    .venv/bin/python benchmarks/bench_sliding_window.py [--new-tokens 64] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import MistralConfig, MistralForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from dflash_trt import SamplingParams  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.layers.attention import kernel_step  # noqa: E402
from dflash_trt.models import llama  # noqa: E402
from dflash_trt.models.dflash import DFlashConfig, load_drafter, new_drafter, save_drafter  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402

WINDOW, PROMPT = 128, 160
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, sliding_window=WINDOW, max_position_embeddings=2048,
             tie_word_embeddings=True, eos_token_id=0, bos_token_id=1)


def torch_past_the_window(meta, cache, *tensors, **kwargs):
    """The kernels as before dd4980c: attending without a window, they served only while it hid nothing (every
    layer of this target slides)."""
    return None if meta.kv_len > WINDOW else kernel_step(meta, cache, *tensors, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="sliding_window_cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = Path(tmp) / "target"
        MistralForCausalLM(MistralConfig(**SHAPE)).to(torch.bfloat16).save_pretrained(target_dir)
        target = load_target(target_dir, dtype=torch.bfloat16)
        drafter_dir = Path(tmp) / "drafter"
        cfg = DFlashConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64, vocab_size=49152, block_size=4,
                           target_layer_ids=[1, 15, 28], mask_token_id=2, num_target_layers=30)
        save_drafter(new_drafter(cfg, seed=0), drafter_dir)
        drafter = load_drafter(drafter_dir, target.config, torch.bfloat16)
        prompt = torch.randint(3, SHAPE["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        engines = {
            "plain": LLMEngine(target, None, None, EngineConfig(max_batch_size=1, max_model_len=512, dtype="bfloat16",
                                                                speculative=False)),
            "K=3": LLMEngine(target, None, drafter, EngineConfig(max_batch_size=1, max_model_len=512, dtype="bfloat16",
                                                                 max_draft_len=3)),
        }
        guards = {"before": torch_past_the_window, "after": kernel_step}
        tok_s: dict[str, dict[str, list[float]]] = {e: {g: [] for g in guards} for e in engines}
        outputs: dict[str, dict[str, list[int]]] = {e: {} for e in engines}
        prefill_s: dict[str, list[float]] = {g: [] for g in guards}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for name, engine in engines.items():
                for guard, fn in guards.items():
                    llama.kernel_step = fn
                    start = time.perf_counter()
                    out = engine.generate([prompt], params)[0]
                    took = time.perf_counter() - start
                    outputs[name][guard] = out.token_ids
                    if round_:  # decoding alone: the prompt's prefill (past the window too) is timed apart
                        tok_s[name][guard].append(len(out.token_ids) / (took - out.prefill_time))
                        prefill_s[guard].append(out.prefill_time)
        llama.kernel_step = kernel_step
    result = {}
    for name in engines:
        pairs = [a / b for a, b in zip(tok_s[name]["after"], tok_s[name]["before"])]
        result[name] = {"before_tok_s": round(statistics.median(tok_s[name]["before"]), 1),
                        "after_tok_s": round(statistics.median(tok_s[name]["after"]), 1),
                        "ratios": [round(r, 3) for r in pairs], "median_ratio": round(statistics.median(pairs), 3),
                        "identical_outputs": outputs[name]["before"] == outputs[name]["after"]}
        print(name, result[name])
    result["prefill_s"] = {g: round(statistics.median(v), 4) for g, v in prefill_s.items()}
    print("prefill_s", result["prefill_s"])
    print("written", record(args.name, {"shape": SHAPE, "prompt_tokens": PROMPT, "new_tokens": args.new_tokens,
                                        "rounds": args.rounds, "threads": args.threads, "results": result}))


if __name__ == "__main__":
    main()
