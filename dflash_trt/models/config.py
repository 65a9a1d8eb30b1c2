"""Architecture facts of a target model, read from an HF `config.json` through transformers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict  # standardized rope parameters: rope_theta, rope_type, scaling keys
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    extra: dict = field(default_factory=dict, compare=False)  # family-specific keys (e.g. gpt-oss)

    @property
    def rope_type(self) -> str:
        return self.rope.get("rope_type", "default")


def read_config_json(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json; expected an HF-format model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


def standardized_rope(cfg: dict) -> dict:
    """Rope parameters in transformers 5.x's `rope_parameters` layout, whichever layout config.json uses
    (5.x `rope_parameters`, or legacy `rope_scaling` + `rope_theta`)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    if "partial_rotary_factor" in cfg:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    return params


def decoder_config_from_dict(cfg: dict, source: str = "config.json") -> DecoderConfig:
    def need(key: str):
        if key not in cfg:
            raise ValueError(f"{source}: missing key {key!r}")
        return cfg[key]

    archs = cfg.get("architectures") or []
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    model_type = cfg.get("model_type", "llama")
    return DecoderConfig(
        architecture=archs[0] if archs else "",
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=standardized_rope(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        eos_token_ids=eos_ids,
        model_type=model_type,
        extra=cfg,
    )
