"""Checkpoint conversion: a GGUF file -> an HF safetensors directory (config, weights, tokenizer).

transformers reads and dequantizes the GGUF (undoing llama.cpp's q/k permutation); the result is
saved once in fp32, so every later load takes a fraction of a second and is bit-identical to what
transformers itself computes from the GGUF.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import sys
from pathlib import Path

from dflash_trt import dir_swap

logger = logging.getLogger(__name__)

WRITING, REPLACED = "convert", "convert-old"  # dir_swap's kinds: `.OUT.convert-PID-HEX` and so on


class GGUFMissing(FileNotFoundError):
    """The GGUF file is not there (not the disk's fault)."""


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write config.json, model.safetensors and the tokenizer for `gguf_path` into `out_dir`, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise GGUFMissing(f"{gguf_path}: GGUF file not found")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # what a killed conversion left (hundreds of MB, under a dot-name nobody looks for)
    dir_swap.remove_stale(out_dir.parent, WRITING, REPLACED, complete=lambda old: (old / "config.json").is_file(),
                          name=out_dir.name)
    tmp = dir_swap.temp_beside(out_dir, WRITING)
    with dir_swap.held(tmp):
        try:
            # Said on stderr, not logged: at the default log level the tokenizer's part of the conversion (the first
            # ten seconds or so, before transformers' own progress bars) would look like a hang.
            print(f"converting {gguf_path} into {out_dir} (once; about 30 s for SmolLM2-135M)", file=sys.stderr,
                  flush=True)
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
                model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            except (ValueError, EOFError, struct.error) as e:  # a cut-short or damaged file: in numpy's words
                raise ValueError(f"{gguf_path}: not a GGUF checkpoint transformers reads ({type(e).__name__}: {e}); "
                                 "it may be truncated or corrupt, or of an architecture it does not support") from e
            # The GGUF quantizer marks the model unserializable; the weights are already dequantized.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            dir_swap.swap_in(tmp, out_dir, REPLACED)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
