"""config.json `architectures` -> this project's model class (one dict), and target loading."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from dflash_trt.layers.rotary import SUPPORTED_ROPE_TYPES
from dflash_trt.models.config import (SILU_NAMES, DecoderConfig, decoder_config_from_dict, generation_eos_ids,
                                     read_config_json)
from dflash_trt.models.gpt_oss import GptOssForCausalLM
from dflash_trt.models.llama import LlamaForCausalLM
from dflash_trt.models.qwen3_5 import Qwen3_5ForCausalLM
from dflash_trt.models.qwen3_moe import Qwen3MoeForCausalLM
from dflash_trt.models.weights import WeightSet


TARGET_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,  # its language model; the vision tower is not read
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def runtime_class(cfg: DecoderConfig, source: str) -> type[nn.Module]:
    """The class this project's runtime runs the target with; ValueError naming the key where it runs no such model:
    an architecture it lacks, or a Llama-family or Qwen3.5 model of another activation than SiLU (gpt-oss's clamped
    SwiGLU is its own, whatever hidden_act says, as in transformers)."""
    cls = TARGET_ARCHITECTURES.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"{source}: architectures={[cfg.architecture] if cfg.architecture else []!r} is not "
                         f"supported by this project's runtime; supported: {', '.join(sorted(TARGET_ARCHITECTURES))}")
    if issubclass(cls, (LlamaForCausalLM, Qwen3_5ForCausalLM)) and cfg.hidden_act not in SILU_NAMES:
        raise ValueError(f"{source}: hidden_act={cfg.hidden_act!r} is not supported by this project's runtime "
                         "(its Llama-family and Qwen3.5 MLPs and Qwen3.5's convolution are SiLU-gated)")
    if cfg.rope["rope_type"] not in SUPPORTED_ROPE_TYPES:  # else refused as the model is built, naming no file
        raise ValueError(f"{source}: rope_type={cfg.rope['rope_type']!r} is not supported by this project's runtime; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return cls


def load_target(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                check_finite: bool = False) -> nn.Module:
    """check_finite: refuse a tensor holding NaN or Inf (for directories no build checked)."""
    model_dir = Path(model_dir)
    cfg = decoder_config_from_dict(read_config_json(model_dir), str(model_dir / "config.json"))
    eos = tuple(dict.fromkeys(cfg.eos_token_ids + generation_eos_ids(model_dir)))
    cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    cls = runtime_class(cfg, str(model_dir / "config.json"))
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to(dtype).to_empty(device=device)  # allocated in dtype: fp32 first would double the peak
    weights = WeightSet(model_dir, check_finite=check_finite)
    with torch.no_grad():
        model.load_weights(weights)
    weights.check_no_layers_beyond(cfg.num_hidden_layers)
    weights.warn_unused(cls.__name__, getattr(cls, "unread_prefixes", ()))
    return model.eval()
