"""Qwen3-MoE target (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B), this project's own
code: Qwen3's attention (per-head q/k norm) and, on its sparse layers, a mixture of SwiGLU experts; a router without
bias softmaxes its logits over all experts in float32, keeps the top k (renormalised to sum to one where
norm_topk_prob says so) and weighs their outputs by them. Which layers are sparse, as transformers reads config.json:
every decoder_sparse_step-th one (all, at 1) that mlp_only_layers does not list; the others have Qwen3's dense MLP.

Same contract as models/llama.py, whose attention, norms and dense layers it shares; the layers run one by one (the
CPU kernels' one-call stack holds dense layers only), each attention through the kernels where they serve.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt.kernels import cpu_ops
from dflash_trt.layers.experts import SiluExperts
from dflash_trt.models.config import DecoderConfig, Qwen3MoeParams
from dflash_trt.models.llama import LlamaForCausalLM
from dflash_trt.models.weights import CheckpointError, WeightSet


class Qwen3MoE(nn.Module):
    def __init__(self, cfg: DecoderConfig, p: Qwen3MoeParams) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = p.num_experts_per_tok, p.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, p.num_experts, bias=False)  # the router
        self.experts = SiluExperts(cfg.hidden_size, p.moe_intermediate_size, range(p.num_experts), bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], weights [T, k] in x's dtype), as transformers routes (float32 softmax over
        every expert, then the top k)."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return ids, top.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return self.experts(flat, *self.route(flat)).view_as(x)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__(cfg)
        self.params = p = Qwen3MoeParams.from_config(cfg)
        for layer, sparse in zip(self.layers, p.sparse):
            if sparse:
                layer.mlp = Qwen3MoE(cfg, p)

    def _pack_extra(self) -> None:
        for layer, sparse in zip(self.layers, self.params.sparse):
            if sparse:
                layer.mlp.experts.pack()

    def _build_layer_table(self) -> cpu_ops.LayerTable | None:
        return None if any(self.params.sparse) else super()._build_layer_table()

    def _load_mlp(self, weights: WeightSet, i: int, own: dict[str, nn.Parameter]) -> None:
        """A sparse layer's router and experts (each expert's own tensors, as Qwen's checkpoints and transformers
        save them, or stacked, as transformers holds them: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
        if not self.params.sparse[i]:
            return super()._load_mlp(weights, i, own)
        load_routed_experts(weights, f"model.layers.{i}.mlp.", self.layers[i].mlp, self.params,
                            self.config.hidden_size)


def load_routed_experts(weights: WeightSet, m: str, moe: Qwen3MoE, p: Qwen3MoeParams, h: int) -> None:
    """A sparse layer's router and experts under prefix m (each expert's own tensors, as Qwen's checkpoints and
    transformers save them, or stacked, as transformers holds them: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    e, inter = p.num_experts, p.moe_intermediate_size
    moe.gate.weight.data.copy_(weights.get(m + "gate.weight", (e, h)))
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    if m + "experts.gate_up_proj" in weights:
        gate_up.data.copy_(weights.get(m + "experts.gate_up_proj", (e, 2 * inter, h)))
        down.data.copy_(weights.get(m + "experts.down_proj", (e, h, inter)))
        return
    if m + "experts.0.gate_proj.weight" not in weights:
        raise CheckpointError(f"{weights.model_dir}: missing tensor {m + 'experts.0.gate_proj.weight'!r} "
                              f"(each expert's) or {m + 'experts.gate_up_proj'!r} (stacked)")
    for x in range(e):
        ex = f"{m}experts.{x}."
        gate_up.data[x, :inter].copy_(weights.get(ex + "gate_proj.weight", (inter, h)))
        gate_up.data[x, inter:].copy_(weights.get(ex + "up_proj.weight", (inter, h)))
        down.data[x].copy_(weights.get(ex + "down_proj.weight", (h, inter)))
