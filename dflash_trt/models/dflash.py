"""The DFlash drafter (arXiv 2602.06036 §3, z-lab/dflash `DFlashDraftModel`), this project's own code.

A Qwen3-style decoder stack with no embedding or LM head of its own. Target features of committed
tokens (the outputs of `target_layer_ids`, concatenated) go through `fc` and `hidden_norm` and are
injected into every layer as extra K/V, through that layer's own k_proj / k_norm / v_proj with RoPE at
the tokens' absolute positions; they never act as queries. The block [anchor, MASK x K] attends
non-causally over [context K/V ; block K/V] (causally, within a window, on sliding layers).

Context K/V live in a per-row cache indexed by absolute position, [0, L); the block's own K/V at
[L, L + Q) are passed to `dflash::draft_attention` (kernels/draft_attention.py) and never stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from dflash_trt.engine.kv_cache import KVCache
from dflash_trt.kernels import cpu_ops
from dflash_trt.kernels.draft_attention import draft_attention
from dflash_trt.layers.attention import AttentionMetadata, attend, kernel_step
from dflash_trt.layers.linear import kernel_weights, pack_linears
from dflash_trt.layers.norm import RMSNorm
from dflash_trt.layers.rotary import RotaryEmbedding, apply_rotary
from dflash_trt.models.config import (
    DecoderConfig,
    SILU_NAMES,
    as_bool,
    as_float,
    as_int,
    as_int_list,
    qwen3_layer_types,
    read_config_json,
    standardized_rope,
)
from dflash_trt.models.llama import GatedMLP
from dflash_trt.models.weights import CheckpointError, WeightSet
from dflash_trt.spec.draft_vocab import load_draft_vocab

logger = logging.getLogger(__name__)

SUPPORTED_DRAFTER_MODEL_TYPES = ("qwen3",)
# dflash_config keys of DFlash 2 drafters (z-lab's DFlash2DraftModel): convolutions and a selector this runtime lacks
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# A drafter step runs in one call to the CPU kernels up to this many rows (a step's block, a few steps' features):
# its int8 projections' VNNI dots grow with the rows, and a prompt's features are better served per layer.
ONE_CALL_MAX_ROWS = 32


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: evenly spaced between the 2nd and the third-to-last target layer."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int  # draft_block_size: 1 anchor + (block_size - 1) masks
    mask_token_id: int
    target_layer_ids: list[int]
    vocab_size: int | None = None
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0})
    max_position_embeddings: int = 40960
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: causal exactly on sliding layers
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> "DFlashConfig":
        dflash = cfg.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise CheckpointError(f"{source}: 'dflash_config' must be an object of keys, got {dflash!r}")
        if not dflash and not any(k in cfg for k in ("target_layer_ids", "num_target_layers", "block_size")):
            # else the first key it lacks is named, which does not say a target was given for the drafter
            raise CheckpointError(f"{source}: not a DFlash drafter (no dflash_config, target_layer_ids or block_size): "
                                  f"is it a target model ({cfg.get('model_type', 'unknown')})? The drafter is a z-lab "
                                  "DFlash checkpoint")

        def value(key, default=None):
            return dflash.get(key, cfg.get(key, default))

        def need(key):
            v = value(key)
            if v is None:
                raise CheckpointError(f"{source}: missing key {key!r} (looked in dflash_config, then the top level)")
            return v

        archs = cfg.get("architectures") or []
        dflash2 = [key for key in DFLASH2_KEYS if value(key)]
        if "DFlash2DraftModel" in archs or dflash2:
            # its convolutions and candidate selector would be dropped as unused tensors, its drafts not DFlash 2's
            raise CheckpointError(f"{source}: a DFlash 2 drafter ({', '.join(dflash2) or 'DFlash2DraftModel'}: "
                                  "convolutions and a candidate selector) is not supported; only DFlash drafters "
                                  "(DFlashDraftModel) are")
        model_type = cfg.get("model_type", "qwen3")
        if model_type not in SUPPORTED_DRAFTER_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: drafter model_type={model_type!r} is not supported; DFlash drafters are Qwen3-style "
                f"decoder stacks (model_type one of {SUPPORTED_DRAFTER_MODEL_TYPES}) whatever the target family"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in SILU_NAMES:
            raise CheckpointError(f"{source}: hidden_act={act!r} is not supported (only SiLU: 'silu' or 'swish')")
        def whole(key: str, v=None, minimum: int | None = 1) -> int:
            return as_int(need(key) if v is None else v, key, source, minimum)

        heads = whole("num_attention_heads")
        hidden = whole("hidden_size")
        layers = whole("num_hidden_layers")
        ids = value("target_layer_ids")
        if ids is None:
            ids = build_target_layer_ids(whole("num_target_layers"), layers)
        # as transformers' Qwen3Config reads them, so as z-lab's DFlashDraftModel gets them
        try:
            layer_types, top_window = qwen3_layer_types(cfg, layers, source)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        causal = dflash.get("causal", cfg.get("is_causal"))
        window = value("swa_window_size") if dflash.get("use_swa") else top_window
        if window is None and cfg.get("sliding_window") and "sliding_attention" in layer_types:
            logger.warning("%s: sliding_window=%s is not used (use_sliding_window is not true): its sliding layers "
                           "attend causally without a window, as transformers' Qwen3Config and z-lab's drafter read "
                           "them", source, cfg["sliding_window"])
        optional = {key: None if cfg.get(key) is None else whole(key, cfg[key])
                    for key in ("vocab_size", "num_target_layers")}
        softcap = value("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            # a key present as 0 is that 0, refused, not the default
            num_key_value_heads=whole("num_key_value_heads", heads if cfg.get("num_key_value_heads") is None
                                      else cfg["num_key_value_heads"]),
            head_dim=whole("head_dim", hidden // heads if cfg.get("head_dim") is None else cfg["head_dim"]),
            intermediate_size=whole("intermediate_size"),
            block_size=whole("block_size", value("block_size", 16), minimum=None),
            mask_token_id=whole("mask_token_id", minimum=0),
            target_layer_ids=as_int_list(ids, "target_layer_ids", source),
            **optional,
            rms_norm_eps=as_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", source, positive=True),
            attention_bias=as_bool(cfg.get("attention_bias"), "attention_bias", source, False),
            rope=standardized_rope(cfg, source),
            max_position_embeddings=whole("max_position_embeddings", cfg.get("max_position_embeddings", 40960)),
            layer_types=layer_types,
            sliding_window=whole("sliding_window", window) if window else None,
            is_causal=None if causal is None else as_bool(
                causal, "dflash_config.causal" if "causal" in dflash else "is_causal", source, False),
            input_embedding_scale=as_float(value("input_embedding_scale", 1.0), "input_embedding_scale", source),
            output_multiplier=as_float(value("output_multiplier", 1.0), "output_multiplier", source),
            final_logit_softcapping=None if softcap is None else as_float(softcap, "final_logit_softcapping", source),
        )

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def to_hf_dict(self) -> dict:
        """config.json in z-lab's format (loads in `dflash.DFlashDraftModel`)."""
        d = asdict(self)
        rope = d.pop("rope")
        dflash = {"mask_token_id": d.pop("mask_token_id"), "target_layer_ids": d.pop("target_layer_ids")}
        for key in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
            value = d.pop(key)
            if value not in (None, 1.0):
                dflash[key] = value
        causal = d.pop("is_causal")
        if causal is not None:
            d["is_causal"] = causal
        layer_types = d.pop("layer_types") or ["full_attention"] * self.num_hidden_layers
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **d,
            "layer_types": layer_types,
            "use_sliding_window": self.sliding_window is not None,
            "hidden_act": "silu",
            "rope_theta": rope.get("rope_theta"),
            "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
            "tie_word_embeddings": False,
            "attention_dropout": 0.0,
            "dflash_config": dflash,
        }

    def check_pairing(self, target: DecoderConfig, source: str = "drafter config.json") -> None:
        """Raise with the offending key when this drafter cannot serve `target`."""
        if self.hidden_size != target.hidden_size:
            raise CheckpointError(
                f"{source}: hidden_size={self.hidden_size} does not match the target's hidden_size={target.hidden_size}"
            )
        if self.vocab_size is not None and int(self.vocab_size) != target.vocab_size:
            raise CheckpointError(
                f"{source}: vocab_size={self.vocab_size} does not match the target's vocab_size={target.vocab_size}"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise CheckpointError(
                f"{source}: mask_token_id={self.mask_token_id} is outside the target's embedding "
                f"(vocab_size={target.vocab_size} rows)"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad or not self.target_layer_ids:
            raise CheckpointError(
                f"{source}: target_layer_ids={self.target_layer_ids} must be non-empty and within the target's "
                f"{target.num_hidden_layers} layers (0..{target.num_hidden_layers - 1}); out of range: {bad}"
            )
        if self.block_size < 2:
            raise CheckpointError(f"{source}: block_size={self.block_size} must be >= 2")
        if self.num_target_layers is not None and int(self.num_target_layers) != target.num_hidden_layers:
            raise CheckpointError(f"{source}: num_target_layers={self.num_target_layers} but the target has "
                                  f"{target.num_hidden_layers} layers (the drafter was trained for another target)")


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.attention_bias)
        self.kv_proj = nn.Linear(cfg.hidden_size, 2 * kv_size, bias=cfg.attention_bias)  # k_proj ; v_proj
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        sliding = cfg.layer_type(layer_idx) == "sliding_attention"
        self.is_causal = sliding if cfg.is_causal is None else cfg.is_causal
        self.sliding_window = cfg.sliding_window if sliding else None
        self.scale = self.head_dim**-0.5

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [B, N, H] -> k (normed, rotated), v: [B, N, kv_heads, head_dim]
        return self._norm_rotate_kv(self.kv_proj(x), cos, sin)

    def _norm_rotate_kv(self, kv: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = kv.shape
        k, v = kv.view(b, n, 2, self.num_kv_heads, self.head_dim).unbind(2)
        k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin).transpose(1, 2)
        return k, v

    def write_context(self, ctx: torch.Tensor, cos, sin, meta: AttentionMetadata, cache: KVCache) -> None:
        kv = self.kv_proj(ctx)
        step = kernel_step(meta, cache, kv, cos, max_queries=None)
        if step is not None:  # the CPU kernel: k norm, rotary and the write in one call (no query heads)
            ops, keys = step
            norms = (self.k_norm.weight, self.k_norm.weight, self.k_norm.eps)
            ops.qkv_rotary_write(kv, cos, sin, keys.rows, keys.positions, cache.k[self.layer_idx],
                                 cache.v[self.layer_idx], 0, norms)
            return
        k, v = self._norm_rotate_kv(kv, cos, sin)
        cache.write(self.layer_idx, meta, k, v)

    def forward(self, x, cos, sin, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        b, n, _ = x.shape
        step = None if self.is_causal or self.sliding_window else kernel_step(meta, cache, x, cos)
        if step is not None:
            # The CPU kernels: the block's K/V are written right after the row's context (room the proposer's
            # cache keeps; the next context write overwrites them), so every query sees one prefix [0, block_end).
            ops, keys = step
            qkv = torch.cat([self.q_proj(x), self.kv_proj(x)], dim=-1)
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]
            q = ops.qkv_rotary_write(qkv, cos, sin, keys.rows, keys.positions, k_cache, v_cache, self.num_heads, norms)
            out = ops.cached_attention(q, k_cache, v_cache, keys.rows, keys.lens, self.scale)
            return self.o_proj(out.view(b, n, -1))
        q = self.q_norm(self.q_proj(x).view(b, n, self.num_heads, self.head_dim))
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k, v = self.project_kv(x, cos, sin)  # the block's own K/V join the context (never written: scratch)
        # The block starts right after the row's context: its first position is the context length.
        out = draft_attention(
            q.transpose(1, 2), k, v, cache.k[self.layer_idx], cache.v[self.layer_idx], meta.rows, meta.positions[:, 0],
            self.scale, self.is_causal, self.sliding_window or 0,
        )
        return self.o_proj(out.flatten(2))

    def forward_train(self, x, cos, sin, ctx_k, ctx_v, mask: torch.Tensor) -> torch.Tensor:
        """Training form without a cache: keys are [context K/V ; block K/V] under an explicit mask."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.num_heads, self.head_dim))
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)
        v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        return self.o_proj(attend(q, k, v, mask, self.scale))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, meta, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_train(self, x, cos, sin, ctx, ctx_cos, ctx_sin, mask):
        ctx_k, ctx_v = self.self_attn.project_kv(ctx, ctx_cos, ctx_sin)
        x = x + self.self_attn.forward_train(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _int8(kernel_weight: torch.Tensor) -> cpu_ops.Int8Weight:
    """A projection's bf16 kernel weight in int8 for the drafter's C tables."""
    return cpu_ops.Int8Weight(cpu_ops.load().plain_weight(kernel_weight))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        # Ranked token ids shipped beside the checkpoint (spec/draft_vocab.py); not a weight, never exported.
        self.draft_vocab: torch.Tensor | None = None
        self.kernel_table: cpu_ops.LayerTable | None = None  # set by pack_for_inference where the kernels serve
        self.context_table: cpu_ops.ContextTable | None = None  # likewise, for draft()'s one-call path

    def make_cache(self, num_rows: int, max_len: int) -> KVCache:
        c = self.config
        p = self.norm.weight  # projections may be prepacked (layers/linear.py) and carry no .weight
        return KVCache(c.num_hidden_layers, num_rows, max_len, c.num_key_value_heads, c.head_dim, p.dtype, p.device)

    def project_context(self, features: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> None:
        """Inject target features [B, N, H * n_features] at meta.positions into every layer's K/V."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self.rotary(meta.positions, ctx.dtype)
        for layer in self.layers:
            layer.self_attn.write_context(ctx, cos, sin, meta, cache)

    def forward_block(self, block_embeds: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """block_embeds [B, Q, H] at meta.positions -> final-normed hidden [B, Q, H]."""
        x = block_embeds
        cos, sin = self.rotary(meta.positions, x.dtype)
        table = self.kernel_table
        fits = table is not None and x.shape[0] * x.shape[1] <= ONE_CALL_MAX_ROWS
        step = kernel_step(meta, cache, x) if fits else None
        if step is not None:
            # Every layer in one C call: a drafter layer is a Llama layer once q_proj and kv_proj are one projection
            # (the block's K/V written after the context, as DFlashAttention's kernel path does; bit-identical to it).
            ops, keys = step
            out = ops.llama_layers(x, table, cache.k, cache.v, cos, sin, keys.rows, keys.positions, keys.lens)
            if out is not None:
                return self.norm(out[0])
        for layer in self.layers:
            x = layer(x, cos, sin, meta, cache)
        return self.norm(x)

    def draft(
        self, features: torch.Tensor, context_meta: AttentionMetadata | None, block_embeds: torch.Tensor,
        block_meta: AttentionMetadata, cache: KVCache,
    ) -> torch.Tensor:
        """project_context(features, context_meta) then forward_block(block_embeds, block_meta): in one C call where
        the kernels serve both (bit-identical; a decode step's Python between them is ~0.3 ms on the CPU)."""
        if features.shape[1] == 0:  # every row's context is in the cache already (no context_meta then)
            return self.forward_block(block_embeds, block_meta, cache)
        fused = (
            self.context_table is not None and block_embeds.dtype == torch.bfloat16
            # the row counts at which project_context's and forward_block's linears take the same kernels
            and features.shape[0] * features.shape[1] <= ONE_CALL_MAX_ROWS
            and block_embeds.shape[0] * block_embeds.shape[1] <= ONE_CALL_MAX_ROWS
        )
        if fused:
            block = kernel_step(block_meta, cache, block_embeds, features)
            context = kernel_step(context_meta, cache, features, max_queries=None)
            if block is not None and context is not None:
                (ops, keys), (_, context_keys) = block, context
                cos, sin = self.rotary(block_meta.positions, block_embeds.dtype)
                context_cos, context_sin = self.rotary(context_meta.positions, block_embeds.dtype)
                out = ops.dflash_step(
                    features, self.context_table, context_cos, context_sin, context_keys.rows, context_keys.positions,
                    block_embeds, self.kernel_table, cache.k, cache.v, cos, sin, keys.rows, keys.positions, keys.lens,
                )
                if out is not None:
                    return out
        self.project_context(features, context_meta, cache)
        return self.forward_block(block_embeds, block_meta, cache)

    def pack_for_inference(self, int8_weights: bool | None = False) -> None:
        """Prepack the projections for CPU inference and, where the bf16 kernels serve every layer, build the tables
        that run a block through all of them (and draft() whole) in one call. int8_weights: the tables' projections
        in int8 (cpu_ops.Int8Weight, one scale per output feature; half the bytes each step streams) where the CPU
        has the kernel; None: only where it beats bf16 at a block's rows (AVX512-VNNI's VPDPBUSD; AVX2's VPMADDWD
        ties, cpu_ops.int8_dot). The layers' own torch path (long contexts) keeps bf16."""
        if self.norm.weight.device.type != "cpu":
            return  # nothing to pack off the CPU (the C kernels would be compiled for nothing)
        pack_linears(self)
        ops = cpu_ops.load()
        dot = ops.int8_dot() if ops is not None else None
        int8 = dot is not None and (int8_weights or (int8_weights is None and dot == "vpdpbusd"))
        # past the int8 kernels' inputs (a fc over 9 features of 8,192) the tables stay bf16: opening refused it
        c = self.config
        int8 = int8 and max(self.fc.in_features, c.intermediate_size, c.num_attention_heads * c.head_dim) <= (
            cpu_ops.Int8Weight.MAX_INPUTS)
        self.kernel_table = self._build_layer_table(int8)
        self.context_table = self._build_context_table(int8) if self.kernel_table is not None else None

    def _build_context_table(self, int8: bool) -> cpu_ops.ContextTable | None:
        attns = [layer.self_attn for layer in self.layers]
        weights = kernel_weights(self.fc, *(a.kv_proj for a in attns))
        eps = {self.hidden_norm.eps, self.norm.eps, self.kernel_table.eps}
        if weights is None or len(eps) > 1 or any(a.k_norm.eps != self.kernel_table.qk_eps for a in attns):
            return None  # one eps per kind is what the C step takes
        if int8:
            weights = [_int8(w) for w in weights]
        per_layer = [[w, a.kv_proj.bias, a.k_norm.weight] for w, a in zip(weights[1:], attns)]
        return cpu_ops.ContextTable(weights[0], self.hidden_norm.weight, self.norm.weight, per_layer,
                                    self.hidden_norm.eps)

    def _build_layer_table(self, int8: bool) -> cpu_ops.LayerTable | None:
        c = self.config
        if any(layer.self_attn.is_causal or layer.self_attn.sliding_window for layer in self.layers):
            return None  # blocks that are not one visible prefix: the layers' own path
        ops = cpu_ops.load()
        entries = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            weights = kernel_weights(a.q_proj, a.kv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            if weights is None:
                return None
            q, kv, o, gate_up, down = weights
            qkv_plain = torch.cat([ops.plain_weight(q), ops.plain_weight(kv)])
            if int8:  # from the plain weights: the fused qkv is never laid out for the bf16 kernel
                qkv = cpu_ops.Int8Weight(qkv_plain)
                o, gate_up, down = (_int8(w) for w in (o, gate_up, down))
            else:
                qkv = ops.kernel_weight(qkv_plain)
            qkv_bias = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.kv_proj.bias])
            entries.append([layer.input_layernorm.weight, qkv, qkv_bias, o, a.o_proj.bias,
                            layer.post_attention_layernorm.weight, gate_up, m.gate_up_proj.bias,
                            down, m.down_proj.bias, a.q_norm.weight, a.k_norm.weight])
        a = self.layers[0].self_attn
        return cpu_ops.LayerTable(entries, c.num_attention_heads, c.intermediate_size, c.rms_norm_eps, a.q_norm.eps,
                                  a.scale, int8)

    def forward_train(
        self,
        features: torch.Tensor,  # [B, S, H * n_features] context features
        feature_positions: torch.Tensor,  # [B, S]
        block_embeds: torch.Tensor,  # [B, M, H] all blocks of the sequence, concatenated
        block_positions: torch.Tensor,  # [B, M]
        mask: torch.Tensor,  # [B, 1, M, S + M] bool (train/blocks.py training_mask)
    ) -> torch.Tensor:
        """The same computation as project_context + forward_block, for many blocks at once."""
        ctx = self.hidden_norm(self.fc(features))
        ctx_cos, ctx_sin = self.rotary(feature_positions, ctx.dtype)
        cos, sin = self.rotary(block_positions, block_embeds.dtype)
        x = block_embeds
        for layer in self.layers:
            x = layer.forward_train(x, cos, sin, ctx, ctx_cos, ctx_sin, mask)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Logits through the target's shared output head (`lm_head`: hidden -> logits)."""
        logits = lm_head(hidden).float()
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            cap = float(c.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: WeightSet) -> None:
        """Load z-lab names (unprefixed: fc.weight, layers.0.self_attn.k_proj.weight, ...), fusing k/v."""
        c = self.config
        own = dict(self.named_parameters())
        h, q_size, kv_size = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

        def put(name: str, value: torch.Tensor) -> None:
            own[name].data.copy_(value)

        put("fc.weight", weights.get("fc.weight", (h, len(c.target_layer_ids) * h)))
        put("hidden_norm.weight", weights.get("hidden_norm.weight", (h,)))
        put("norm.weight", weights.get("norm.weight", (h,)))
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            for n in ("input_layernorm", "post_attention_layernorm"):
                put(f"{p}{n}.weight", weights.get(f"{p}{n}.weight", (h,)))
            a = p + "self_attn."
            put(a + "q_proj.weight", weights.get(a + "q_proj.weight", (q_size, h)))
            k = weights.get(a + "k_proj.weight", (kv_size, h))
            v = weights.get(a + "v_proj.weight", (kv_size, h))
            put(a + "kv_proj.weight", torch.cat([k, v]))
            put(a + "o_proj.weight", weights.get(a + "o_proj.weight", (h, q_size)))
            if c.attention_bias:
                put(a + "q_proj.bias", weights.get(a + "q_proj.bias", (q_size,)))
                kb, vb = weights.get(a + "k_proj.bias", (kv_size,)), weights.get(a + "v_proj.bias", (kv_size,))
                put(a + "kv_proj.bias", torch.cat([kb, vb]))
                put(a + "o_proj.bias", weights.get(a + "o_proj.bias", (h,)))
            put(a + "q_norm.weight", weights.get(a + "q_norm.weight", (c.head_dim,)))
            put(a + "k_norm.weight", weights.get(a + "k_norm.weight", (c.head_dim,)))
            m = p + "mlp."
            gate = weights.get(m + "gate_proj.weight", (c.intermediate_size, h))
            up = weights.get(m + "up_proj.weight", (c.intermediate_size, h))
            put(m + "gate_up_proj.weight", torch.cat([gate, up]))
            put(m + "down_proj.weight", weights.get(m + "down_proj.weight", (h, c.intermediate_size)))
        weights.check_no_layers_beyond(c.num_hidden_layers)  # else it would draft with some of them
        weights.warn_unused(type(self).__name__)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under z-lab's unprefixed names, k/v and gate/up split back."""
        c = self.config
        kv_size = c.num_key_value_heads * c.head_dim
        out = {}
        for name, t in self.state_dict().items():
            t = t.detach().contiguous()
            if ".kv_proj." in name:
                k, v = t.split(kv_size, dim=0)
                out[name.replace("kv_proj", "k_proj")] = k.contiguous()
                out[name.replace("kv_proj", "v_proj")] = v.contiguous()
            elif ".gate_up_proj." in name:
                gate, up = t.chunk(2, dim=0)
                out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
                out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
            else:
                out[name] = t
        return out


def load_drafter(
    drafter_dir: str | Path, target: DecoderConfig, dtype: torch.dtype = torch.float32, device: str = "cpu",
    check_finite: bool = False,
) -> DFlashDrafter:
    """check_finite: refuse a tensor holding NaN or Inf (for directories no build checked)."""
    drafter_dir = Path(drafter_dir)
    source = str(drafter_dir / "config.json")
    cfg = DFlashConfig.from_dict(read_config_json(drafter_dir), source)
    cfg.check_pairing(target, source)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model = model.to(dtype).to_empty(device=device)  # allocated in dtype: fp32 first would double the peak
    with torch.no_grad():
        model.load_weights(WeightSet(drafter_dir, check_finite=check_finite))
    model.draft_vocab = load_draft_vocab(drafter_dir, target.vocab_size)
    return model.eval()


def new_drafter(cfg: DFlashConfig, seed: int = 0, init_std: float = 0.02) -> DFlashDrafter:
    """A freshly initialised drafter (normal(0, init_std) linears, unit norms), as HF initialises Qwen3."""
    g = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
    return model


def save_drafter(model: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors in z-lab's format (loads unchanged in `dflash`)."""
    import json

    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf_dict()
    tensors = model.hf_state_dict()
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
        cfg["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    weights = out_dir / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights))
    # safetensors writes 0600: a server run as another user could not read the drafter beside its config.json, whose
    # mode (the umask's) it takes
    weights.chmod((out_dir / "config.json").stat().st_mode & 0o777)
    return out_dir
