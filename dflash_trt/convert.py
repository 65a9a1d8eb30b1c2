"""Checkpoint conversion: a GGUF file -> an HF safetensors directory (config, weights, tokenizer).

transformers reads and dequantizes the GGUF (undoing llama.cpp's q/k permutation); the result is
saved once in fp32, so every later load takes a fraction of a second and is bit-identical to what
transformers itself computes from the GGUF.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write config.json, model.safetensors and the tokenizer for `gguf_path` into `out_dir`, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: GGUF file not found")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        # Said on stderr, not logged: at the default log level the tokenizer's part of the conversion (the first
        # ten seconds or so, before transformers' own progress bars) would look like a hang.
        print(f"converting {gguf_path} into {out_dir} (once; about 30 s for SmolLM2-135M)", file=sys.stderr,
              flush=True)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        # The GGUF quantizer marks the model unserializable; the weights are already dequantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
