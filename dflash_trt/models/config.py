"""Architecture facts of a target model, read from an HF `config.json` through transformers."""

from __future__ import annotations

import json
import math
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
    hidden_act: str = "silu"
    # per layer, the keys a query sees back from its own position (None: all of them); empty where none slides
    layer_windows: tuple[int | None, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)  # family-specific keys (e.g. gpt-oss)
    source: str = field(default="config.json", compare=False)  # where it was read: errors name it

    @property
    def rope_type(self) -> str:
        return self.rope.get("rope_type", "default")

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None


def read_config_json(model_dir: str | Path) -> dict:
    if Path(model_dir).is_file():  # config.json or a .safetensors named in its directory's place
        raise NotADirectoryError(f"{model_dir} is a file; name the model directory that holds it "
                                 f"({Path(model_dir).parent})")
    path = Path(model_dir) / "config.json"
    if path.exists() and not path.is_file():  # a folder, a pipe (whose read waits for a writer)
        raise ValueError(f"{path}: not a regular file; expected the model's config.json")
    if not path.is_file():
        if (path.parent / "manifest.json").is_file():
            hint = f" ({path.parent} is an engine: its target is {path.parent / 'target'})"
        elif (path.parent / "drafter" / "config.json").is_file():
            hint = f" ({path.parent} is a `dflash-trt train` --out: its drafter is {path.parent / 'drafter'})"
        else:
            hint = ""
        raise FileNotFoundError(f"{path.parent}: no config.json; expected an HF-format model directory{hint}")
    return read_json_object(path, "of config keys")


def eos_token_ids(cfg: dict, source: str) -> tuple[int, ...]:
    """A config's eos_token_id (an id or a list of them) as a tuple."""
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        return tuple(as_int_list(eos, "eos_token_id", source))
    return () if eos is None else (as_int(eos, "eos_token_id", source),)


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The eos ids of the model's generation_config.json (none without one): Qwen2.5-Instruct's ends its turns with
    151645, which config.json names, and also stops at 151643, which only generation_config.json does; transformers'
    generate and vLLM stop at both."""
    path = Path(model_dir) / "generation_config.json"
    return eos_token_ids(read_json_object(path), str(path)) if path.is_file() else ()


def read_json_object(path: Path, holding: str = "") -> dict:
    """The JSON object in file `path`; ValueError naming it where it is not JSON, not UTF-8 or not an object."""
    try:
        loaded = json.loads(path.read_bytes())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a JSON object{' ' + holding if holding else ''}, got "
                         f"{type(loaded).__name__}")
    return loaded


def as_int(value, key: str, source: str, minimum: int | None = None) -> int:
    """A config value that must be a whole number (576 or 576.0; not "576", 576.9, [576] or true), naming the key."""
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise ValueError(f"{source}: {key!r} must be a whole number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{source}: {key!r} must be >= {minimum}, got {value!r}")
    return int(value)


def as_float(value, key: str, source: str, positive: bool = False) -> float:
    """A config value that must be a number; positive: a finite one above 0 (an rms_norm_eps or rope_theta of 0 or
    below turns every activation into NaN, and the engine answers nothing but token 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{source}: {key!r} must be a number, got {value!r}")
    if positive and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{source}: {key!r} must be a finite number above 0, got {value!r}")
    return float(value)


def as_bool(value, key: str, source: str, default: bool) -> bool:
    """A config flag: JSON's true or false (null: the default); "false" or 0 would read as the opposite or pass as
    one, where transformers refuses them."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key!r} must be true or false, got {value!r}")
    return value


def as_int_list(value, key: str, source: str) -> list[int]:
    if not isinstance(value, list):
        raise ValueError(f"{source}: {key!r} must be a list of whole numbers, got {value!r}")
    return [as_int(v, f"{key}[{i}]", source) for i, v in enumerate(value)]


# rope parameters that are numbers where given (null: transformers computes the default, as for attention_factor)
ROPE_NUMBERS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "low_freq_factor",
                "high_freq_factor", "attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor")
# what each scaled rope_type divides by, so needs (transformers' _compute_*_parameters read them without a default;
# YaRN's factor, where absent, is derived from the two context lengths, in layers/rotary.py as in transformers)
ROPE_NEEDS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def standardized_rope(cfg: dict, source: str = "config.json") -> dict:
    """Rope parameters in transformers 5.x's `rope_parameters` layout, whichever layout config.json uses
    (5.x `rope_parameters`, or legacy `rope_scaling` + `rope_theta`); a value of the wrong type named."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    given = cfg.get(key) or {}
    if not isinstance(given, dict):
        raise ValueError(f"{source}: {key!r} must be an object of rope parameters, got {given!r}")
    params = dict(given)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    if "partial_rotary_factor" in cfg:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    elif cfg.get("model_type") in HYBRID_MODEL_TYPES:  # transformers' Qwen3.5 configs rotate a quarter unless told
        params.setdefault("partial_rotary_factor", 0.25)
    if not isinstance(params["rope_type"], str):
        raise ValueError(f"{source}: {key}.rope_type must be a string, got {params['rope_type']!r}")
    as_float(params["rope_theta"], "rope_theta", source, positive=True)
    for name in ROPE_NUMBERS:
        if params.get(name) is not None:
            as_float(params[name], f"{key}.{name}", source, positive=name in ROPE_NEEDS["llama3"])
    missing = [name for name in ROPE_NEEDS.get(params["rope_type"], ()) if params.get(name) is None]
    if missing:
        raise ValueError(f"{source}: rope_type {params['rope_type']!r} needs {key}.{missing[0]}")
    if params["rope_type"] == "llama3" and params["low_freq_factor"] == params["high_freq_factor"]:
        # the smoothing between them divides by their difference: NaN frequencies
        raise ValueError(f"{source}: {key}.low_freq_factor and high_freq_factor must differ (both "
                         f"{params['low_freq_factor']!r})")
    return params


LAYER_TYPES = ("full_attention", "sliding_attention")
SILU_NAMES = ("silu", "swish")  # transformers' ACT2CLS: both are SiLU


def qwen3_layer_types(cfg: dict, layers: int, source: str) -> tuple[list[str], int | None]:
    """(type of each layer, the window of its sliding ones) as transformers' Qwen3Config reads them: the top-level
    sliding_window (4096 where absent) counts only with use_sliding_window, and missing layer_types come from it and
    max_window_layers (layers from there on slide)."""
    window = cfg.get("sliding_window", 4096) if as_bool(cfg.get("use_sliding_window"), "use_sliding_window", source,
                                                        False) else None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = layers if window is None else as_int(cfg.get("max_window_layers", 28), "max_window_layers", source,
                                                     minimum=None)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        raise ValueError(f"{source}: 'layer_types' must list one type per layer ({layers}), got {layer_types!r}")
    unknown = sorted({str(t) for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"{source}: layer_types {unknown} are not supported; layers are one of {LAYER_TYPES}")
    return layer_types, None if window is None else as_int(window, "sliding_window", source, minimum=1)


def _target_windows(cfg: dict, model_type: str, layers: int, source: str) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers' model of that family applies it: Mistral on every layer (4096
    where config.json has no sliding_window), Qwen3 on its sliding layers (qwen3_layer_types), Qwen3-MoE on every
    layer where use_sliding_window says so, Llama on none."""
    slides = model_type in ("qwen3", "qwen3_moe") and as_bool(cfg.get("use_sliding_window"), "use_sliding_window",
                                                               source, False)
    if model_type == "mistral" or (slides and model_type == "qwen3_moe"):  # every layer (4096 where it says none)
        window = cfg.get("sliding_window", 4096)
        windows = (None if window is None else as_int(window, "sliding_window", source, minimum=1),) * layers
    elif slides:
        layer_types, window = qwen3_layer_types(cfg, layers, source)
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    else:
        return ()
    return windows if any(w is not None for w in windows) else ()


def _check_planned_keys(cfg: dict, source: str) -> None:
    """Keys the planner and the performance model read from config.json's raw dict (DecoderConfig.extra), of the
    type they read, where given: one of another type failed there with a traceback."""
    for key in ("dtype", "torch_dtype"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise ValueError(f"{source}: {key!r} must be a dtype's name, got {cfg[key]!r}")
    if cfg.get("quantization_config") is not None and not isinstance(cfg["quantization_config"], dict):
        raise ValueError(f"{source}: 'quantization_config' must be an object, got {cfg['quantization_config']!r}")
    types = cfg.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise ValueError(f"{source}: 'layer_types' must be a list of layer type names, got {types!r}")
    if cfg.get("sliding_window") not in (None, False, 0):  # those: no window, as the planner reads them
        as_int(cfg["sliding_window"], "sliding_window", source, minimum=1)
    for key in ("num_local_experts", "num_experts", "num_experts_per_tok"):
        if cfg.get(key) is not None:
            as_int(cfg[key], key, source, minimum=0)


def language_model_config(cfg: dict, source: str = "config.json") -> dict:
    """A multimodal checkpoint's language model keys as one config (Qwen3.5's config.json keeps them under
    text_config, beside a vision_config; its architectures, and tie_word_embeddings where given, stay the top
    level's, as do its eos_token_id and quantization_config where text_config has none); any other config as it
    is."""
    text = cfg.get("text_config")
    if text is None or "num_hidden_layers" in cfg:
        return cfg
    if not isinstance(text, dict):
        raise ValueError(f"{source}: 'text_config' must be an object of the language model's keys, got {text!r}")
    merged = dict(text)
    for key in ("architectures", "tie_word_embeddings", "eos_token_id", "quantization_config"):
        if cfg.get(key) is not None and (key in ("architectures", "tie_word_embeddings") or merged.get(key) is None):
            merged[key] = cfg[key]
    return merged


def decoder_config_from_dict(cfg: dict, source: str = "config.json") -> DecoderConfig:
    cfg = language_model_config(cfg, source)

    def need(key: str):
        if key not in cfg:
            raise ValueError(f"{source}: missing key {key!r}")
        return cfg[key]

    def whole(key: str, default=None, minimum: int | None = 1) -> int:
        # a key present as 0 is that 0, refused (as a default it once hid a bad num_key_value_heads)
        return as_int(need(key) if default is None or cfg.get(key) is not None else default, key, source, minimum)

    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{source}: 'architectures' must be a list of class names, got {archs!r}")
    act = cfg.get("hidden_act", "silu")
    if not isinstance(act, str):
        raise ValueError(f"{source}: 'hidden_act' must be an activation's name, got {act!r}")
    heads = whole("num_attention_heads")
    hidden = whole("hidden_size")
    eos_ids = eos_token_ids(cfg, source)
    model_type = cfg.get("model_type", "llama")
    layers = whole("num_hidden_layers")
    _check_planned_keys(cfg, source)
    return DecoderConfig(
        architecture=archs[0] if archs else "",
        vocab_size=whole("vocab_size"),
        hidden_size=hidden,
        # 0: the perf model's attention-only stand-in, or a model of experts alone (Qwen3.5-MoE lists none)
        intermediate_size=whole("intermediate_size", 0 if model_type in HYBRID_MOE_MODEL_TYPES else None, minimum=0),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=whole("num_key_value_heads", heads),
        head_dim=whole("head_dim", hidden // heads),
        rms_norm_eps=as_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", source, positive=True),
        rope=standardized_rope(cfg, source),
        max_position_embeddings=whole("max_position_embeddings", 4096),
        tie_word_embeddings=as_bool(cfg.get("tie_word_embeddings"), "tie_word_embeddings", source, False),
        attention_bias=as_bool(cfg.get("attention_bias"), "attention_bias", source, False),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        mlp_bias=as_bool(cfg.get("mlp_bias"), "mlp_bias", source, False),
        eos_token_ids=eos_ids,
        model_type=model_type,
        hidden_act=act,
        layer_windows=_target_windows(cfg, model_type, layers, source),
        extra=cfg,
        source=source,
    )


@dataclass(frozen=True)
class Qwen3MoeParams:
    """Qwen3-MoE's facts, read from DecoderConfig.extra (the config.json dict) with transformers' defaults."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse: tuple[bool, ...]  # per layer: whether it routes to experts

    @classmethod
    def from_config(cls, cfg: DecoderConfig) -> "Qwen3MoeParams":
        raw, source = cfg.extra, f"{cfg.source} (qwen3_moe)"
        # (Qwen's config.json says num_experts; transformers 5 saves it as num_local_experts, gpt-oss's name)
        key = "num_experts" if "num_experts" in raw else "num_local_experts"
        experts = as_int(raw.get(key, 128), key, source, minimum=0)
        top_k = as_int(raw.get("num_experts_per_tok", 8), "num_experts_per_tok", source, minimum=1)
        if experts and not 1 <= top_k <= experts:
            raise ValueError(f"{source}: num_experts_per_tok={top_k} must be in 1..num_experts={experts}")
        step = as_int(raw.get("decoder_sparse_step", 1), "decoder_sparse_step", source, minimum=1)
        dense = raw.get("mlp_only_layers") or []
        if not (isinstance(dense, list) and all(isinstance(i, int) for i in dense)):
            raise ValueError(f"{source}: mlp_only_layers must be a list of layer indices, got {dense!r}")
        return cls(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=as_int(raw.get("moe_intermediate_size", 768), "moe_intermediate_size", source,
                                         minimum=1),
            norm_topk_prob=as_bool(raw.get("norm_topk_prob"), "norm_topk_prob", source, False),
            sparse=tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)),
        )


HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                        "Qwen3_5MoeForConditionalGeneration")
HYBRID_MOE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", *HYBRID_MOE_MODEL_TYPES)


def is_hybrid(cfg: DecoderConfig) -> bool:
    """Whether the target mixes linear-attention layers in (Qwen3.5's language model, dense or MoE)."""
    return cfg.architecture in HYBRID_ARCHITECTURES or cfg.model_type in HYBRID_MODEL_TYPES


HYBRID_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen3_5Params:
    """Qwen3.5's own keys, read from DecoderConfig.extra with transformers' defaults."""

    layer_types: tuple[str, ...]
    conv_kernel: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    experts: "Qwen3MoeParams | None" = None  # Qwen3.5-MoE's routed experts, on every layer
    shared_expert_intermediate: int = 0  # and its gated shared expert

    @classmethod
    def from_config(cls, cfg: DecoderConfig) -> "Qwen3_5Params":
        raw, source = cfg.extra, f"{cfg.source} (qwen3_5)"
        types = raw.get("layer_types")
        if types is None:
            interval = as_int(raw.get("full_attention_interval", 4), "full_attention_interval", source, minimum=1)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(cfg.num_hidden_layers)]
        if not isinstance(types, list) or len(types) != cfg.num_hidden_layers:
            raise ValueError(f"{source}: 'layer_types' must list one type per layer ({cfg.num_hidden_layers}), got "
                             f"{types!r}")
        unknown = sorted({str(t) for t in types if t not in HYBRID_LAYER_TYPES})
        if unknown:
            raise ValueError(f"{source}: layer_types {unknown} are not supported; layers are one of "
                             f"{HYBRID_LAYER_TYPES}")

        def whole(key: str, default: int) -> int:
            return as_int(raw.get(key, default), key, source, minimum=1)

        experts, shared = None, 0
        if cfg.model_type in HYBRID_MOE_MODEL_TYPES or "Moe" in cfg.architecture:
            # its router always renormalises the top k (no norm_topk_prob key)
            e, top_k = whole("num_experts", 256), whole("num_experts_per_tok", 8)
            if top_k > e:
                raise ValueError(f"{source}: num_experts_per_tok={top_k} must be in 1..num_experts={e}")
            experts = Qwen3MoeParams(e, top_k, whole("moe_intermediate_size", 512), True,
                                     (True,) * cfg.num_hidden_layers)
            shared = whole("shared_expert_intermediate_size", 512)
        p = cls(tuple(types), whole("linear_conv_kernel_dim", 4), whole("linear_num_key_heads", 16),
                whole("linear_num_value_heads", 32), whole("linear_key_head_dim", 128),
                whole("linear_value_head_dim", 128), experts, shared)
        if p.value_heads % p.key_heads:
            raise ValueError(f"{source}: linear_num_value_heads={p.value_heads} must be a multiple of "
                             f"linear_num_key_heads={p.key_heads}")
        return p

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def linear_layers(self) -> int:
        return self.layer_types.count("linear_attention")

    def state_bytes(self, dtype_bytes: int) -> int:
        """One row's state in one linear layer: the fp32 recurrent state and the convolution's history."""
        return 4 * self.value_heads * self.key_dim * self.value_dim + (self.conv_kernel - 1) * self.conv_channels * \
            dtype_bytes

    def mixer_values(self, hidden: int) -> int:
        """One linear layer's mixer weights (its input and output projections, convolution, norm and gates)."""
        value = self.value_heads * self.value_dim
        return hidden * (self.conv_channels + value + 2 * self.value_heads) + value * hidden + \
            self.conv_channels * self.conv_kernel + self.value_dim + 2 * self.value_heads



@dataclass(frozen=True)
class MoeShape:
    """A target's mixture of experts as the planner reads it."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int  # one expert's
    sparse_layers: int  # the layers that route to experts; the others' MLP is dense, of the intermediate_size
    biases: bool  # the router's and the experts' (gpt-oss's)


def moe_shape(t: DecoderConfig) -> MoeShape | None:
    """The target's experts (None for a dense model): Qwen3-MoE's as its runtime reads them (Qwen3MoeParams), other
    families' where config.json says num_local_experts (gpt-oss's, on every layer)."""
    if is_hybrid(t):
        experts = Qwen3_5Params.from_config(t).experts
        return None if experts is None else MoeShape(experts.num_experts, experts.num_experts_per_tok,
                                                      experts.moe_intermediate_size, t.num_hidden_layers, False)
    if t.model_type == "qwen3_moe":
        p = Qwen3MoeParams.from_config(t)
        # (experts on no layer, mlp_only_layers listing them all: a dense model, as the runtime runs it)
        return MoeShape(p.num_experts, p.num_experts_per_tok, p.moe_intermediate_size, sum(p.sparse), False) \
            if any(p.sparse) else None
    experts = t.extra.get("num_local_experts")
    if not experts:
        return None
    return MoeShape(int(experts), int(t.extra.get("num_experts_per_tok") or 1), t.intermediate_size,
                    t.num_hidden_layers, t.model_type == "gpt_oss")
