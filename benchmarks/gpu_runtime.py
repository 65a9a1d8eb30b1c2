"""The torch runtime's decoding step on a GPU: milliseconds and host syncs a step, plain and speculative, by batch size.

No checkpoint is needed (the device machine reaches no network and a device call carries 64 MiB): the target and
the drafter are built from the bundled configs (dflash_trt/model_configs, Qwen3-8B and z-lab's Qwen3-8B-DFlash-b16
drafter) with random weights on the device. What random weights leave meaningless is acceptance: speculative steps
are timed as steps (a chain of K drafts, a tree of N nodes), whatever they accept, with the schedule and the adaptive
mode off. Host syncs are counted by torch's CUDA sync debug mode (each one waits for every kernel queued before it:
the host can no longer run ahead of the GPU).

    python benchmarks/gpu_runtime.py [--batches 1,8,32] [--k 7] [--tree-nodes 6] [--steps 24] [--out NAME]
    python benchmarks/gpu_runtime.py --model qwen3.5   # a hybrid target, as below
    python benchmarks/gpu_runtime.py --device cpu --model smoke   # a dry run of the script itself, small shapes

--model qwen3.5: transformers' default Qwen3.5 language model (32 layers, every fourth full attention, hidden 4,096,
vocab 248,320) with the Qwen3-8B drafter's shape paired to it (the same hidden size; its features from layers
1, 8, 15, 22, 29): the delta rule's Triton kernel (chains; a tree's nodes run the torch loop) and the recurrent
states' bookkeeping in a step.

Writes benchmarks/results/NAME.json (default gpu_runtime_<gpu>). Several minutes at most on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import device_name, record, require_device  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.models.config import decoder_config_from_dict  # noqa: E402
from dflash_trt.models.dflash import DFlashConfig, DFlashDrafter  # noqa: E402
from dflash_trt.models.registry import TARGET_ARCHITECTURES  # noqa: E402
from dflash_trt.sampling_params import SamplingParams  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "dflash_trt" / "model_configs"
SMOKE = {  # a few layers of the same families, for a dry run on the CPU
    "target": {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
               "tie_word_embeddings": False},
    "drafter": {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16, "num_target_layers": 4,
                "dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 2]}, "num_hidden_layers": 2,
                "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                "rope_theta": 1e6},
}


def _random(model: torch.nn.Module, device: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    model = model.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def _qwen3_5(smoke: bool) -> tuple[dict, dict]:
    """A Qwen3.5 language model's config (transformers' defaults, or smoke's widths) and a drafter paired to it."""
    from transformers import Qwen3_5TextConfig

    widths = {k: v for k, v in SMOKE["target"].items() if k != "architectures"} if smoke else {}
    target = Qwen3_5TextConfig(**widths, **(dict(linear_num_key_heads=2, linear_num_value_heads=4,
                                                  linear_key_head_dim=16, linear_value_head_dim=16) if smoke else {}))
    target_raw = {**target.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}
    drafter_raw = dict(SMOKE["drafter"]) if smoke else json.loads((CONFIGS / "qwen3-8b-dflash-b16.json").read_text())
    layers = target.num_hidden_layers
    drafter_raw.update(vocab_size=target.vocab_size, num_target_layers=layers, dflash_config={
        **drafter_raw["dflash_config"], "target_layer_ids": [1, 2] if smoke else [1, 8, 15, 22, 29]})
    return target_raw, drafter_raw


def build(model: str, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, DFlashDrafter]:
    if model == "smoke":
        target_raw, drafter_raw = SMOKE["target"], SMOKE["drafter"]
    elif model in ("qwen3.5", "qwen3.5-smoke"):
        target_raw, drafter_raw = _qwen3_5(model.endswith("smoke"))
    else:
        target_raw = json.loads((CONFIGS / "qwen3-8b.json").read_text())
        drafter_raw = json.loads((CONFIGS / "qwen3-8b-dflash-b16.json").read_text())
    cfg = decoder_config_from_dict(target_raw, "target config")
    dcfg = DFlashConfig.from_dict(drafter_raw, "drafter config")
    dcfg.check_pairing(cfg, "drafter config")
    with torch.device("meta"):
        target, drafter = TARGET_ARCHITECTURES[cfg.architecture](cfg), DFlashDrafter(dcfg)
    return _random(target, device, dtype, 0), _random(drafter, device, dtype, 1)


class SyncCounter:
    """Counts the synchronizing CUDA calls torch warns of in sync debug mode ("warn")."""

    def __init__(self, device: str) -> None:
        self.on = device.startswith("cuda")
        self.count = 0

    def __enter__(self):
        if self.on:
            self._catch = warnings.catch_warnings(record=True)
            self._seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            # one warning a synchronizing call ("called a synchronizing CUDA operation"), not the mode's own notice
            self.count = sum("called a synchronizing" in str(w.message) for w in self._seen)
            self._catch.__exit__(*exc)


def time_steps(target, drafter, device: str, dtype: torch.dtype, batch: int, steps: int, prompt_len: int, k: int,
               **config) -> dict:
    """Median ms a step while `batch` requests decode together (every prompt prefilled, a few warm steps), then host
    syncs a step over as many more (counted apart: the debug mode's warnings cost time of their own)."""
    longest = prompt_len + (k + 1) * (2 * steps + batch + 8)  # room for every draft of every step accepted
    engine = LLMEngine(target, None, drafter, EngineConfig(
        max_batch_size=batch, max_model_len=longest, device=device, dtype=str(dtype)[6:], draft_len_schedule={},
        adaptive_draft_len=False, **config))
    g = torch.Generator().manual_seed(batch)
    vocab = target.config.vocab_size
    params = SamplingParams(max_new_tokens=longest - prompt_len, ignore_eos=True)
    seqs = [engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
            for _ in range(batch)]
    while not all(s.output_ids for s in seqs):  # prompts (max_prefill_tokens of chunks a step)
        engine.step()
    for _ in range(3):  # warm steps: kernels compiled, caches grown
        engine.step()
    on_cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    times, syncs = [], []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    for _ in range(steps if on_cuda else 0):
        with SyncCounter(device) as counter:
            engine.step()
        syncs.append(counter.count)
    assert not any(s.is_finished for s in seqs), "a request finished inside the timed steps"
    del engine
    return {"batch": batch, "ms_per_step": round(statistics.median(times), 3),
            "syncs_per_step": statistics.median(syncs) if on_cuda else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", choices=["qwen3-8b", "qwen3.5", "smoke", "qwen3.5-smoke"], default="qwen3-8b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--tree-nodes", type=int, default=6)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_device(args.device, "--device cpu --model smoke")
    dtype = torch.bfloat16
    target, drafter = build(args.model, args.device, dtype)
    systems = {
        "plain": dict(speculative=False),
        f"chain K={args.k}": dict(max_draft_len=args.k),
        f"tree K={args.k} nodes={args.tree_nodes}": dict(max_draft_len=args.k, draft_tree={1: args.tree_nodes}),
    }
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for name, config in systems.items():
            row = {"system": name, **time_steps(target, drafter if name != "plain" else None, args.device, dtype,
                                                batch, args.steps, args.prompt_len, args.k, **config)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    path = record(args.out or f"gpu_runtime_{device_name(args.device)}", {
        "model": args.model, "dtype": "bfloat16", "prompt_len": args.prompt_len, "steps": args.steps, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
