"""Llama-family target (Llama, SmolLM2, Mistral, Qwen3 with per-head q/k norm), this project's own code.

Sliding layers (Mistral's, Qwen3's with use_sliding_window) keep full-length cache rows and hide the keys outside
their window by mask, as gpt-oss's do.

forward(input_ids, meta, cache) runs any number of new tokens per row against the static cache and
captures the outputs of the requested decoder layers: layer l's output is transformers'
hidden_states[l + 1] (after the residual add; the last layer's after the final norm too). Logits are separate
(compute_logits) so callers only project the positions they need.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.engine.kv_cache import KVCache
from dflash_trt.kernels import cpu_ops
from dflash_trt.layers.attention import (KERNEL_MAX_QUERIES, AttentionMetadata, cached_attention, kernel_attention,
                                         kernel_step, kernel_step_tokens)
from dflash_trt.layers.linear import kernel_weights
from dflash_trt.layers.norm import RMSNorm
from dflash_trt.layers.rotary import RotaryEmbedding, apply_rotary
from dflash_trt.models.causal_lm import CausalLM
from dflash_trt.models.config import DecoderConfig
from dflash_trt.models.weights import WeightSet


class LlamaAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.window(layer_idx)

    def forward(self, x, cos, sin, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv_proj(x)
        whole = b * n <= kernel_step_tokens(self.qkv_proj)  # a step the kernels attend whatever its rows' queries
        step = kernel_step(meta, cache, qkv, cos, max_queries=None if whole else KERNEL_MAX_QUERIES)
        if step is not None:  # the CPU kernels: rotary + cache write, then attention, one call each
            norms = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            out = kernel_attention(step, cache, self.layer_idx, qkv, cos, sin, self.num_heads, self.scale,
                                   self.sliding_window, norms)
            return self.o_proj(out.view(b, n, -1))
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(b, n, self.num_heads, self.head_dim)
        k = k.view(b, n, self.num_kv_heads, self.head_dim)
        v = v.view(b, n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        out = cached_attention(cache, self.layer_idx, meta, q, k.transpose(1, 2), v, self.scale,
                               window=self.sliding_window)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = cpu_ops.for_tensors(gate_up)
        if ops is not None:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, cos, sin, meta, cache):
        h, x = self.post_attention_layernorm.forward_with_residual(
            self.self_attn(self.input_layernorm(x), cos, sin, meta, cache), x
        )
        return x + self.mlp(h)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.kernel_table: cpu_ops.LayerTable | None = None  # set by pack_for_inference where the kernels serve
        self.one_call_max_tokens = 0  # steps of up to this many tokens take kernel_table

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: KVCache, capture_layer_ids: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Decode, verify and prompt steps on the CPU: every layer in one call to the kernels, so Python's per-layer and
        # per-op overhead goes (up to 16 queries a row the same kernels in the same order as the layers' own CPU path:
        # bit-identical; above, that path attends with SDPA).
        table = self.kernel_table
        fits = table is not None and input_ids.numel() <= self.one_call_max_tokens
        # a row's queries are at most the step's tokens: fits bounds both
        step = kernel_step(meta, cache, self.embed_tokens.weight, max_queries=None) if fits else None
        if step is not None:
            ops, keys = step
            x = self.embed_tokens(input_ids)
            cos, sin = self.rotary(meta.rope_positions, x.dtype)
            out = ops.llama_layers(x, table, cache.k, cache.v, cos, sin, keys.rows, keys.positions, keys.lens,
                                   tuple(capture_layer_ids), keys.tree)
            if out is not None:
                return self.finish(out[0], out[1], tuple(capture_layer_ids))
        return super().forward(input_ids, meta, cache, capture_layer_ids)

    def pack_for_inference(self, screen_head: bool = True) -> None:
        super().pack_for_inference(screen_head)
        self.kernel_table = self._build_layer_table()
        # the layers' attention runs through the kernels whatever a row's queries up to this many tokens a step
        self.kernel_attention_tokens = kernel_step_tokens(self.layers[0].self_attn.qkv_proj)
        if self.kernel_table is not None:  # every layer in one call as far as the kernels' attention serves whole steps
            self.one_call_max_tokens = self.kernel_attention_tokens

    def _build_layer_table(self) -> cpu_ops.LayerTable | None:
        """The layers' weights for cpu_ops.llama_layers when every projection runs on the bf16 linear kernel."""
        entries = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            weights = kernel_weights(a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            if weights is None:
                return None
            qkv, o, gate_up, down = weights
            entries.append([layer.input_layernorm.weight, qkv, a.qkv_proj.bias, o, a.o_proj.bias,
                            layer.post_attention_layernorm.weight, gate_up, m.gate_up_proj.bias, down, m.down_proj.bias,
                            None if a.q_norm is None else a.q_norm.weight, None if a.k_norm is None else a.k_norm.weight])
        c = self.config
        a = self.layers[0].self_attn
        return cpu_ops.LayerTable(entries, c.num_attention_heads, c.intermediate_size, c.rms_norm_eps,
                                  a.q_norm.eps if a.q_norm is not None else 0.0, a.scale, windows=c.layer_windows)

    def load_weights(self, weights: WeightSet) -> None:
        """Load HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...), fusing q/k/v and gate/up."""
        c = self.config
        own = dict(self.named_parameters())
        own["embed_tokens.weight"].data.copy_(weights.get("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)))
        own["norm.weight"].data.copy_(weights.get("model.norm.weight", (c.hidden_size,)))
        if self.lm_head is not None:
            own["lm_head.weight"].data.copy_(weights.get("lm_head.weight", (c.vocab_size, c.hidden_size)))
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            own[f"layers.{i}.input_layernorm.weight"].data.copy_(weights.get(p + "input_layernorm.weight", (c.hidden_size,)))
            own[f"layers.{i}.post_attention_layernorm.weight"].data.copy_(
                weights.get(p + "post_attention_layernorm.weight", (c.hidden_size,))
            )
            a = p + "self_attn."
            shapes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
            qkv = [weights.get(f"{a}{n}.weight", (rows, c.hidden_size)) for n, rows in shapes.items()]
            own[f"layers.{i}.self_attn.qkv_proj.weight"].data.copy_(torch.cat(qkv))
            if c.attention_bias:
                qkv_b = [weights.get(f"{a}{n}.bias", (rows,)) for n, rows in shapes.items()]
                own[f"layers.{i}.self_attn.qkv_proj.bias"].data.copy_(torch.cat(qkv_b))
                own[f"layers.{i}.self_attn.o_proj.bias"].data.copy_(weights.get(a + "o_proj.bias", (c.hidden_size,)))
            own[f"layers.{i}.self_attn.o_proj.weight"].data.copy_(weights.get(a + "o_proj.weight", (c.hidden_size, q_size)))
            if c.qk_norm:
                own[f"layers.{i}.self_attn.q_norm.weight"].data.copy_(weights.get(a + "q_norm.weight", (c.head_dim,)))
                own[f"layers.{i}.self_attn.k_norm.weight"].data.copy_(weights.get(a + "k_norm.weight", (c.head_dim,)))
            self._load_mlp(weights, i, own)

    def _load_mlp(self, weights: WeightSet, i: int, own: dict[str, nn.Parameter]) -> None:
        """Layer i's MLP: gate and up fused."""
        c, m = self.config, f"model.layers.{i}.mlp."
        gate = weights.get(m + "gate_proj.weight", (c.intermediate_size, c.hidden_size))
        up = weights.get(m + "up_proj.weight", (c.intermediate_size, c.hidden_size))
        own[f"layers.{i}.mlp.gate_up_proj.weight"].data.copy_(torch.cat([gate, up]))
        own[f"layers.{i}.mlp.down_proj.weight"].data.copy_(
            weights.get(m + "down_proj.weight", (c.hidden_size, c.intermediate_size))
        )
        if c.mlp_bias:
            gb = weights.get(m + "gate_proj.bias", (c.intermediate_size,))
            ub = weights.get(m + "up_proj.bias", (c.intermediate_size,))
            own[f"layers.{i}.mlp.gate_up_proj.bias"].data.copy_(torch.cat([gb, ub]))
            own[f"layers.{i}.mlp.down_proj.bias"].data.copy_(weights.get(m + "down_proj.bias", (c.hidden_size,)))
