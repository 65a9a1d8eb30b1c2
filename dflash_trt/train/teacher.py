"""The target as teacher: its own next-token logits at the training labels' positions, for distillation.

A label is one token the target chose; its logits say how sure it was and what came second, which a
hard label cannot (most informative where a small target is unsure, and its records are few). They are
recomputed from the captured features instead of a whole forward: the deepest captured layer's output
is the residual stream there, so only the layers after it, the final norm and the head rows the
student's softmax covers run (SmolLM2-135M: 2 of 30 layers, for features [1, 8, 14, 20, 27]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_trt.layers.attention import AttentionMetadata


class Teacher:
    def __init__(self, target: torch.nn.Module, target_layer_ids: list[int], head: torch.Tensor) -> None:
        deepest = max(target_layer_ids)
        self.target, self.head = target, head  # head: the target's output rows the student's logits cover
        self.start = deepest + 1
        self.slot = list(target_layer_ids).index(deepest)
        self.hidden = target.config.hidden_size

    @torch.no_grad()
    def logits(self, feats: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 [m, head rows]: the target's logits for the token after positions[i] of sequence rows[i].

        feats [n, L, feature_dim] are the captured features of each sequence's first tokens, right-padded
        (causal: the padding is never seen by the positions asked for).
        """
        p = self.target.embed_tokens.weight
        n, length = feats.shape[:2]
        x = feats[..., self.slot * self.hidden : (self.slot + 1) * self.hidden].to(p.device, p.dtype)
        if self.start == len(self.target.layers):
            hidden = x  # the last layer's feature is already past the final norm (transformers' last hidden state)
        else:
            seq = torch.arange(n, device=p.device)
            meta = AttentionMetadata.causal_step(seq, torch.arange(length, device=p.device).expand(n, length))
            hidden, _ = self.target.run_layers(x, meta, self.target.make_cache(n, length), self.start)
        return F.linear(hidden[rows, positions], self.head.to(hidden.dtype)).float()


def distill_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per row, both softmaxed over the same vocabulary rows -> [m]."""
    p_log = F.log_softmax(teacher, dim=-1)
    return (p_log.exp() * (p_log - F.log_softmax(student, dim=-1))).sum(-1)
