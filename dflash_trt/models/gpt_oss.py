"""gpt-oss target (GptOssForCausalLM: gpt-oss-20b / 120b), this project's own code.

Per layer: attention with q/k/v/o biases, a learned per-head sink logit in the softmax denominator,
YaRN RoPE, GQA, and a sliding window on "sliding_attention" layers (even layers in the released
models); then a mixture of experts: a linear router picks the top-k experts and renormalises their
logits with a softmax, and each expert is a clamped SwiGLU (alpha 1.702, limit 7.0) with biases.
Same contract as models/llama.py: per-row static KV cache indexed by absolute position (rollback is
free), capture of decoder-layer outputs (layer l = transformers' hidden_states[l + 1]).

Sliding layers keep full-length cache rows and hide keys outside the window by mask (exact under
rollback, since visibility depends only on positions); they read only the keys a query can see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.engine.kv_cache import KVCache
from dflash_trt.layers.attention import (KERNEL_MAX_QUERIES, AttentionMetadata, attend, kernel_attention,
                                         kernel_step, kernel_step_tokens)
from dflash_trt.layers.experts import ExpertBank
from dflash_trt.layers.linear import PackedLinear, kernel_serves
from dflash_trt.layers.norm import RMSNorm
from dflash_trt.layers.rotary import RotaryEmbedding, apply_rotary
from dflash_trt.models.causal_lm import CausalLM
from dflash_trt.models.config import DecoderConfig, as_bool, as_float, as_int
from dflash_trt.models.mxfp4 import expert_range, load_experts
from dflash_trt.models.weights import WeightSet

# transformers' GptOssConfig defaults, for keys a config.json leaves out.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


@dataclass(frozen=True)
class GptOssParams:
    """gpt-oss family facts, read from DecoderConfig.extra (the config.json dict) with transformers' defaults."""

    num_local_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    swiglu_alpha: float
    swiglu_limit: float
    attention_bias: bool
    rms_norm_eps: float
    rope: dict

    @classmethod
    def from_config(cls, cfg: DecoderConfig) -> "GptOssParams":
        raw = cfg.extra
        n = cfg.num_hidden_layers
        source = f"{cfg.source} (gpt_oss)"
        layer_types = raw.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
        ]
        if len(layer_types) != n or set(layer_types) - {"sliding_attention", "full_attention"}:
            raise ValueError(
                f"{source}: layer_types={layer_types!r} must list {n} entries of 'sliding_attention'/'full_attention'"
            )
        window = raw.get("sliding_window", 128)
        if "sliding_attention" in layer_types and window is None:
            raise ValueError(f"{source}: layer_types has sliding layers but sliding_window={window!r}")
        window = None if window is None else as_int(window, "sliding_window", source, minimum=1)
        experts = as_int(raw.get("num_local_experts", 128), "num_local_experts", source, minimum=1)
        top_k_key = "num_experts_per_tok" if "num_experts_per_tok" in raw else "experts_per_token"
        top_k = as_int(raw.get(top_k_key, 4), top_k_key, source)
        if not 1 <= top_k <= experts:
            raise ValueError(f"{source}: num_experts_per_tok={top_k} must be in 1..num_local_experts={experts}")
        has_rope = raw.get("rope_parameters") or raw.get("rope_scaling")
        theta = as_float(raw.get("rope_theta", 150000.0), "rope_theta", source)
        rope = cfg.rope if has_rope else {**DEFAULT_ROPE, "rope_theta": theta}
        return cls(
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            layer_types=tuple(layer_types),
            sliding_window=window,
            swiglu_alpha=as_float(raw.get("swiglu_alpha", 1.702), "swiglu_alpha", source),
            swiglu_limit=as_float(raw.get("swiglu_limit", 7.0), "swiglu_limit", source),
            attention_bias=as_bool(raw.get("attention_bias"), "attention_bias", source, True),
            rms_norm_eps=as_float(raw.get("rms_norm_eps", 1e-5), "rms_norm_eps", source),
            rope=rope,
        )


class GptOssRMSNorm(RMSNorm):
    """The weight multiplies in fp32 before the cast back (transformers keeps gpt-oss norms in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)).to(x.dtype)


class GptOssAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, p: GptOssParams, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=p.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=p.attention_bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))  # [H] one sink logit per query head
        self.sliding_window = p.sliding_window if p.layer_types[layer_idx] == "sliding_attention" else None
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata, cache: KVCache, first_key: int) -> torch.Tensor:
        # x: [B, Q, hidden]; first_key: no query of this forward sees a key before it on a sliding layer
        b, n, _ = x.shape
        qkv = self.qkv_proj(x)
        whole = b * n <= kernel_step_tokens(self.qkv_proj)  # a step the kernels attend whatever its rows' queries
        step = kernel_step(meta, cache, qkv, cos, max_queries=None if whole else KERNEL_MAX_QUERIES)
        if step is not None:  # the CPU kernels, as Llama's: each query's output alike whatever rows share the step
            out = kernel_attention(step, cache, self.layer_idx, qkv, cos, sin, self.num_heads, self.scale,
                                   self.sliding_window, sinks=self.sinks)
            return self.o_proj(out.view(b, n, -1))
        q, k, v = qkv.split(self.split, dim=-1)
        q = apply_rotary(q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rotary(k.view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        cache.write(self.layer_idx, meta, k.transpose(1, 2), v.view(b, n, self.num_kv_heads, self.head_dim))
        k_all, v_all = cache.read(self.layer_idx, meta)  # [B, KVH, kv_len, D]
        mask = meta.mask(window=self.sliding_window)  # [B, 1, Q, kv_len] or None
        if self.sliding_window is not None and first_key > 0:
            k_all, v_all = k_all[:, :, first_key:], v_all[:, :, first_key:]
            mask = None if mask is None else mask[..., first_key:]
        out = attend(q, k_all, v_all, mask, self.scale, sinks=self.sinks)
        return self.o_proj(out)


class GptOssExperts(ExpertBank):
    """Clamped SwiGLU experts with biases."""

    def __init__(self, hidden: int, intermediate: int, experts: range, alpha: float, limit: float) -> None:
        super().__init__(hidden, intermediate, experts, bias=True)
        self.alpha, self.limit = alpha, limit

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssMoE(nn.Module):
    def __init__(self, cfg: DecoderConfig, p: GptOssParams, experts: range, ep_size: int) -> None:
        super().__init__()
        self.top_k = p.num_experts_per_tok
        self.ep_size = ep_size
        self.router = nn.Linear(cfg.hidden_size, p.num_local_experts, bias=True)  # replicated on every rank
        self.experts = GptOssExperts(cfg.hidden_size, cfg.intermediate_size, experts, p.swiglu_alpha, p.swiglu_limit)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], weights [T, k]): softmax over the top-k router logits only."""
        logits = self.router(x)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1, dtype=top.dtype)

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over the experts it holds: [B, Q, H] -> [B, Q, H]."""
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.route(flat)
        return self.experts(flat, ids, weights).view_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.forward_local(x)
        if self.ep_size > 1:
            # Expert parallelism: every rank sees all tokens; the ranks' partial sums add up to the layer output.
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError(f"ep_size={self.ep_size} needs torch.distributed initialised (init_process_group)")
            dist.all_reduce(out)
        return out


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, p: GptOssParams, layer_idx: int, experts: range, ep_size: int) -> None:
        super().__init__()
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, p.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, p, layer_idx)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, p.rms_norm_eps)
        self.mlp = GptOssMoE(cfg, p, experts, ep_size)

    def forward(self, x, cos, sin, meta, cache, first_key: int):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, cache, first_key)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg: DecoderConfig, ep_rank: int = 0, ep_size: int = 1) -> None:
        super().__init__()
        self.config = cfg
        self.params = p = GptOssParams.from_config(cfg)
        self.experts = expert_range(p.num_local_experts, ep_rank, ep_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(cfg, p, i, self.experts, ep_size) for i in range(cfg.num_hidden_layers)
        )
        self.norm = GptOssRMSNorm(cfg.hidden_size, p.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, p.rope, cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def _pack_extra(self) -> None:
        for layer in self.layers:
            layer.mlp.experts.pack()
            router = layer.mlp.router
            if isinstance(router, nn.Linear) and kernel_serves(router.weight):
                # without oneDNN's copy the kernel reaches at least AMX tiles' 128 rows: a router of 32 experts
                # (gpt-oss-20b) cannot take the tiles (widths of 64), and on oneDNN past 32 rows it cut every step
                # to 32 rows
                layer.mlp.router = PackedLinear(router.weight, router.bias, onednn=False)

    def pack_for_inference(self, screen_head: bool = True) -> None:
        super().pack_for_inference(screen_head)
        self.kernel_attention_tokens = kernel_step_tokens(self.layers[0].self_attn.qkv_proj)

    def _layer_args(self, meta: AttentionMetadata) -> tuple:
        # Keys before first_key are outside every sliding query's window: sliding layers read from there.
        window = self.params.sliding_window
        return (max(0, meta.first_position - window + 1) if window else 0,)

    def load_weights(self, weights: WeightSet) -> None:
        """Load HF-named tensors (bf16 or MXFP4 experts); this rank reads and dequantizes only its experts."""
        c, p = self.config, self.params
        h = c.hidden_size
        own = dict(self.named_parameters())

        def put(name: str, value: torch.Tensor) -> None:
            own[name].data.copy_(value)

        put("embed_tokens.weight", weights.get("model.embed_tokens.weight", (c.vocab_size, h)))
        put("norm.weight", weights.get("model.norm.weight", (h,)))
        if self.lm_head is not None:
            put("lm_head.weight", weights.get("lm_head.weight", (c.vocab_size, h)))
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shapes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        dtype = self.embed_tokens.weight.dtype
        for i in range(c.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for n in ("input_layernorm", "post_attention_layernorm"):
                put(f"{dst}{n}.weight", weights.get(f"{src}{n}.weight", (h,)))
            a, sa = src + "self_attn.", dst + "self_attn."
            put(sa + "qkv_proj.weight", torch.cat([weights.get(f"{a}{n}.weight", (r, h)) for n, r in shapes.items()]))
            put(sa + "o_proj.weight", weights.get(a + "o_proj.weight", (h, q_size)))
            if p.attention_bias:
                put(sa + "qkv_proj.bias", torch.cat([weights.get(f"{a}{n}.bias", (r,)) for n, r in shapes.items()]))
                put(sa + "o_proj.bias", weights.get(a + "o_proj.bias", (h,)))
            put(sa + "sinks", weights.get(a + "sinks", (c.num_attention_heads,)))
            m, sm = src + "mlp.", dst + "mlp."
            put(sm + "router.weight", weights.get(m + "router.weight", (p.num_local_experts, h)))
            put(sm + "router.bias", weights.get(m + "router.bias", (p.num_local_experts,)))
            ew = load_experts(weights, m + "experts.", p.num_local_experts, h, c.intermediate_size, self.experts, dtype)
            put(sm + "experts.gate_up_proj", ew.gate_up)
            put(sm + "experts.gate_up_proj_bias", ew.gate_up_bias)
            put(sm + "experts.down_proj", ew.down)
            put(sm + "experts.down_proj_bias", ew.down_bias)
