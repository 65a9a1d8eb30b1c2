"""Qwen3.5 targets (Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM, and the language models of their
...ForConditionalGeneration checkpoints: Qwen3.5-4B ... 27B, Qwen3.5-35B-A3B and 122B-A10B),
this project's own code. A hybrid: most layers mix tokens by a gated delta rule (linear attention with a recurrent
state per head and a short causal convolution before it), every few a full attention layer with an output gate; norms
are zero-centred (scaled by 1 + weight); rotary covers a quarter of each head. The MoE models' MLP is Qwen3-MoE's
routed experts plus a gated shared expert.

Same contract as models/llama.py over a HybridCache (engine/hybrid_cache.py), which keeps the linear layers' states
after the last positions of each forward so that a verify block's rejected tokens roll back. The delta rule runs
token by token past a prompt's chunks (layers/delta_rule.py): a verify step takes each token in as a one-token step
does, so both round alike. Text only: the vision tower's weights are left unread, and a text-only prompt's
multimodal rotary positions are the plain ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.engine.hybrid_cache import (MAX_MARKS, MAX_SNAPSHOTS, HybridCache, LinearStates, LinearStateShape,
                                            RowStates, row_states)
from dflash_trt.engine.kv_cache import KVCache
from dflash_trt.layers.attention import AttentionMetadata, cached_attention, kernel_step
from dflash_trt.layers.delta_rule import delta_rule_chunked, delta_rule_steps
from dflash_trt.layers.rotary import RotaryEmbedding, apply_rotary
from dflash_trt.models.causal_lm import CausalLM
from dflash_trt.models.config import DecoderConfig, Qwen3_5Params
from dflash_trt.models.llama import GatedMLP
from dflash_trt.models.qwen3_moe import Qwen3MoE, load_routed_experts
from dflash_trt.models.weights import WeightSet

class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by 1 + weight, in fp32 then cast back (transformers' Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times SiLU of its gate (the delta rule's output norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel by a sigmoid of a second half of q_proj (per head: q, gate)."""

    def __init__(self, cfg: DecoderConfig, kv_layer: int) -> None:
        super().__init__()
        self.kv_layer = kv_layer  # its index among the attention layers (the K/V cache holds only theirs)
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (2 * q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        b, n, _ = x.shape
        q_gate, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q, gate = q_gate.view(b, n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rotary(self.k_norm(k.view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2), cos, sin)
        k, v = k.transpose(1, 2), v.view(b, n, self.num_kv_heads, self.head_dim)
        step = kernel_step(meta, cache, q)
        if step is None:
            out = cached_attention(cache, self.kv_layer, meta, q, k, v, self.scale)
        else:  # the CPU kernels attend query by query: a verify step's queries round as one-token steps' do
            ops, keys = step
            cache.write(self.kv_layer, meta, k, v)
            out = ops.cached_attention(q.transpose(1, 2).reshape(b * n, self.num_heads, self.head_dim),
                                       cache.k[self.kv_layer], cache.v[self.kv_layer], keys.rows, keys.lens,
                                       self.scale, tree=keys.tree).view(b, n, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(b, n, -1)))


def _l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def tree_parents(tree: torch.Tensor) -> list[list[int]]:
    """A draft tree's verify (AttentionMetadata.tree: bit i of [b, j] set where node i is node j or its ancestor) ->
    each node's parent, the nearest of its ancestors (-1 for the root)."""
    parents = []
    for row in tree.tolist():
        parents.append([max((i for i in range(j) if bits >> i & 1), default=-1) for j, bits in enumerate(row)])
    return parents


@dataclass(frozen=True)
class StepRows:
    """What every linear layer of one forward reads of its rows, found once a forward (Qwen3_5ForCausalLM's
    _layer_args): their first positions and real queries, and in a draft tree's verify each node's parent and the
    inputs its convolution reads (conv_windows, [B, Q, taps] on the device)."""

    rows: RowStates
    parents: list[list[int]] | None = None
    windows: torch.Tensor | None = None


def conv_windows(parents: list[list[int]], taps: int) -> list[list[list[int]]]:
    """For each node, the inputs its causal convolution reads, oldest first, as indices into [the row's last taps - 1
    inputs before the step ; the step's]: its own and its nearest ancestors', then those before the step."""
    history = taps - 1
    windows = []
    for row in parents:
        nodes = []
        for j in range(len(row)):
            chain, node = [], j
            while node >= 0 and len(chain) < taps:
                chain.append(history + node)
                node = row[node]
            chain += list(range(history - 1, -1, -1))[: taps - len(chain)]
            nodes.append(chain[::-1])
        windows.append(nodes)
    return windows


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule: per value head a [key, value] state S, decayed by exp(g) and corrected
    towards each token's value, S <- S exp(g) + beta k (v - S^T k exp(g))^T, read by the query; q, k and v come
    through a causal depthwise convolution with SiLU."""

    def __init__(self, cfg: DecoderConfig, p: Qwen3_5Params, state_layer: int) -> None:
        super().__init__()
        self.state_layer = state_layer  # its index among the linear layers
        self.p = p
        key_size, value_size = p.key_heads * p.key_dim, p.value_heads * p.value_dim
        # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a in one
        self.split = (p.conv_channels, value_size, p.value_heads, p.value_heads)
        self.key_size = key_size
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(p.conv_channels, p.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(p.value_heads))
        self.A_log = nn.Parameter(torch.empty(p.value_heads))
        self.norm = GatedRMSNorm(p.value_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, meta: AttentionMetadata, cache: HybridCache, step: StepRows) -> torch.Tensor:
        b, n, _ = x.shape
        p = self.p
        states = cache.linear[self.state_layer]
        rs, parents, windows = step.rows, step.parents, step.windows
        mixed, z, beta, a = self.in_proj(x).split(self.split, dim=-1)
        conv_before, state = states.initial(rs)
        history = torch.cat([conv_before, mixed], dim=1)  # [B, history + Q, channels]
        w = self.conv_weight.float()
        taps = p.conv_kernel
        if windows is not None:  # a draft tree: each node follows its parent, not the node before it
            inputs = [history.gather(1, windows[..., j, None].expand(-1, -1, history.shape[-1])) for j in range(taps)]
            conv = sum(inputs[j].float() * w[:, j] for j in range(taps))
        else:
            conv = sum(history[:, j:j + n].float() * w[:, j] for j in range(taps))
        qkv = F.silu(conv).to(x.dtype)
        q, k, v = qkv.split((self.key_size, self.key_size, p.value_heads * p.value_dim), dim=-1)
        repeat = p.value_heads // p.key_heads
        q = _l2_normed(q.reshape(b, n, p.key_heads, p.key_dim).float()).repeat_interleave(repeat, dim=2)
        k = _l2_normed(k.reshape(b, n, p.key_heads, p.key_dim).float()).repeat_interleave(repeat, dim=2)
        q = q / p.key_dim**0.5
        v = v.reshape(b, n, p.value_heads, p.value_dim).float()
        beta = torch.sigmoid(beta).float()
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [B, Q, heads]
        keep_from = states.keep_from(rs)
        # A prompt's tokens whose states nobody keeps go by chunks, up to a point that depends on the prompt alone
        # (not on how many states an engine keeps), so plain and speculative engines take a prompt in alike; the
        # rest token by token, as one-token steps do, keeping the states wanted.
        split = max(0, min(rs.lens) - MAX_SNAPSHOTS) if parents is None else 0
        head = []
        if split:
            out, state = delta_rule_chunked(q[:, :split], k[:, :split], v[:, :split], beta[:, :split],
                                            log_decay[:, :split], state)
            head.append(out)
        tail, kept = delta_rule_steps(q[:, split:], k[:, split:], v[:, split:], beta[:, split:],
                                      log_decay[:, split:].exp(), state, keep_from - split, parents)
        states.keep(rs, history, kept, keep_from, windows)
        out = torch.cat([*head, tail], dim=1).to(x.dtype)  # [B, Q, heads, value]
        out = self.norm(out, z.reshape(b, n, p.value_heads, p.value_dim))
        return self.out_proj(out.reshape(b, n, -1))


class SharedExpertMoE(nn.Module):
    """Qwen3.5-MoE's MLP: routed experts (Qwen3-MoE's, the top k renormalised) plus a shared expert weighed by a
    sigmoid gate of its own."""

    def __init__(self, cfg: DecoderConfig, p: Qwen3_5Params) -> None:
        super().__init__()
        self.routed = Qwen3MoE(cfg, p.experts)
        self.shared_expert = GatedMLP(cfg.hidden_size, p.shared_expert_intermediate)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, p: Qwen3_5Params, mixer: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = mixer
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size) if p.experts is None else SharedExpertMoE(cfg, p)

    def forward(self, x, cos, sin, meta, cache: HybridCache, step: StepRows):
        h = self.input_layernorm(x)
        if isinstance(self.mixer, GatedAttention):
            x = x + self.mixer(h, cos, sin, meta, cache.kv)
        else:
            x = x + self.mixer(h, cos, sin, meta, cache, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5ForCausalLM(CausalLM):
    # the vision tower, and the multi-token prediction head (the drafter here is DFlash's)
    unread_prefixes = ("model.visual.", "mtp.")

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.params = p = Qwen3_5Params.from_config(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        kinds = p.layer_types
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(cfg, p, GatedAttention(cfg, kinds[:i].count("full_attention"))
                                if kind == "full_attention" else GatedDeltaNet(cfg, p, kinds[:i].count(kind)))
            for i, kind in enumerate(kinds))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def _layer_args(self, meta: AttentionMetadata) -> tuple:
        rows = row_states(meta)
        if meta.tree is None:
            return (StepRows(rows),)
        parents = tree_parents(meta.tree)
        windows = torch.tensor(conv_windows(parents, self.params.conv_kernel), device=meta.positions.device)
        return (StepRows(rows, parents, windows),)

    def _pack_extra(self) -> None:
        if self.params.experts is not None:
            for layer in self.layers:
                layer.mlp.routed.experts.pack()

    def make_cache(self, num_rows: int, max_len: int, queries: int = 16) -> HybridCache:
        c, p = self.config, self.params
        w = self.embed_tokens.weight
        snapshots = max(queries, 1)
        if snapshots > MAX_SNAPSHOTS:
            raise ValueError(f"a step of {snapshots} queries a row (a drafter block, or a draft tree's nodes and its "
                             f"root): {c.architecture}'s linear-attention layers keep the states of at most "
                             f"{MAX_SNAPSHOTS}; draft trees of at most {MAX_SNAPSHOTS - 1} nodes")
        # a row's: its snapshots and marks (hybrid_cache.py)
        states = p.linear_layers * (snapshots + MAX_MARKS) * p.state_bytes(w.dtype.itemsize)
        kv = KVCache(p.layer_types.count("full_attention"), num_rows, max_len, c.num_key_value_heads, c.head_dim,
                     w.dtype, w.device, row_bytes=states)
        shape = LinearStateShape(p.conv_channels, p.conv_kernel - 1, p.value_heads, p.key_dim, p.value_dim)
        return HybridCache(kv, [LinearStates(shape, num_rows, snapshots, w.dtype, w.device)
                                for _ in range(p.linear_layers)])

    def load_weights(self, weights: WeightSet) -> None:
        """HF names: model.layers.N... (Qwen3_5ForCausalLM) or model.language_model.layers.N... (the language model of
        Qwen3_5ForConditionalGeneration); q/k/v and the linear layers' four input projections fused."""
        c, p = self.config, self.params
        h = c.hidden_size
        base = "model.language_model." if "model.language_model.embed_tokens.weight" in weights else "model."
        own = dict(self.named_parameters())

        def put(name: str, tensor: torch.Tensor) -> None:
            own[name].data.copy_(tensor)

        put("embed_tokens.weight", weights.get(base + "embed_tokens.weight", (c.vocab_size, h)))
        put("norm.weight", weights.get(base + "norm.weight", (h,)))
        if self.lm_head is not None:
            put("lm_head.weight", weights.get("lm_head.weight", (c.vocab_size, h)))
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        value_size = p.value_heads * p.value_dim
        for i, layer in enumerate(self.layers):
            src, dst = f"{base}layers.{i}.", f"layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(f"{dst}{norm}.weight", weights.get(f"{src}{norm}.weight", (h,)))
            self._load_mlp(weights, src + "mlp.", layer.mlp)
            if isinstance(layer.mixer, GatedAttention):
                a = src + "self_attn."
                shapes = {"q_proj": 2 * q_size, "k_proj": kv_size, "v_proj": kv_size}
                put(dst + "mixer.qkv_proj.weight", torch.cat([weights.get(f"{a}{n}.weight", (rows, h))
                                                              for n, rows in shapes.items()]))
                if c.attention_bias:
                    put(dst + "mixer.qkv_proj.bias", torch.cat([weights.get(f"{a}{n}.bias", (rows,))
                                                                for n, rows in shapes.items()]))
                    put(dst + "mixer.o_proj.bias", weights.get(a + "o_proj.bias", (h,)))
                put(dst + "mixer.o_proj.weight", weights.get(a + "o_proj.weight", (h, q_size)))
                put(dst + "mixer.q_norm.weight", weights.get(a + "q_norm.weight", (c.head_dim,)))
                put(dst + "mixer.k_norm.weight", weights.get(a + "k_norm.weight", (c.head_dim,)))
                continue
            a = src + "linear_attn."
            shapes = {"in_proj_qkv": p.conv_channels, "in_proj_z": value_size, "in_proj_b": p.value_heads,
                      "in_proj_a": p.value_heads}
            put(dst + "mixer.in_proj.weight", torch.cat([weights.get(f"{a}{n}.weight", (rows, h))
                                                         for n, rows in shapes.items()]))
            put(dst + "mixer.conv_weight", weights.get(a + "conv1d.weight", (p.conv_channels, 1, p.conv_kernel))[:, 0])
            put(dst + "mixer.dt_bias", weights.get(a + "dt_bias", (p.value_heads,)))
            put(dst + "mixer.A_log", weights.get(a + "A_log", (p.value_heads,)))
            put(dst + "mixer.norm.weight", weights.get(a + "norm.weight", (p.value_dim,)))
            put(dst + "mixer.out_proj.weight", weights.get(a + "out_proj.weight", (h, value_size)))

    def _load_mlp(self, weights: WeightSet, m: str, mlp: nn.Module) -> None:
        """A dense MLP (gate and up fused), or Qwen3.5-MoE's routed experts and gated shared expert."""
        c, p = self.config, self.params
        if p.experts is not None:
            load_routed_experts(weights, m, mlp.routed, p.experts, c.hidden_size)
            mlp.shared_expert_gate.weight.data.copy_(weights.get(m + "shared_expert_gate.weight", (1, c.hidden_size)))
            mlp, m = mlp.shared_expert, m + "shared_expert."
        inter = mlp.down_proj.weight.shape[1]
        gate = weights.get(m + "gate_proj.weight", (inter, c.hidden_size))
        up = weights.get(m + "up_proj.weight", (inter, c.hidden_size))
        mlp.gate_up_proj.weight.data.copy_(torch.cat([gate, up]))
        mlp.down_proj.weight.data.copy_(weights.get(m + "down_proj.weight", (c.hidden_size, inter)))
