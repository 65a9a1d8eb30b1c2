"""What every target model gives the runtime: a decoder stack over the static cache with hidden-state
capture, and an output head shared with the drafter. Families (llama.py, gpt_oss.py) subclass it and
build `embed_tokens`, `layers`, `norm`, `rotary`, `lm_head` (None when tied) and `load_weights`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.engine.kv_cache import KVCache
from dflash_trt.layers.argmax import argmax_last
from dflash_trt.layers.attention import AttentionMetadata
from dflash_trt.layers.greedy_head import GreedyHead
from dflash_trt.layers.linear import PackedLinear, can_pack, pack_linears
from dflash_trt.models.config import DecoderConfig


class CausalLM(nn.Module):
    config: DecoderConfig
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear | None

    @property
    def packed_head(self) -> nn.Module | None:
        # A submodule, so no class-level default: one would shadow it (nn.Module keeps submodules in _modules,
        # which attribute lookup reaches only after the class), and the head silently ran unpacked.
        return self._modules.get("_packed_head")

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    _greedy_head: GreedyHead | None = None
    # Steps of up to this many tokens attend through the CPU kernels whatever a row's query count (set where
    # pack_for_inference finds them serving): the engine keeps the steps whose rows must round alike within it.
    kernel_attention_tokens: int = 0

    @property
    def greedy_head(self) -> GreedyHead | None:
        """The head's int8 screen for greedy tokens, where pack_for_inference built one."""
        return self._greedy_head

    def pack_for_inference(self, screen_head: bool = True) -> None:
        """Prepack every projection and the output head for fast CPU inference (no-op elsewhere); screen_head adds
        the head's int8 screen for greedy tokens (layers/greedy_head.py; same tokens, half the bytes read)."""
        if self.packed_head is not None or not can_pack(self.embed_tokens.weight):
            return
        self.add_module("_packed_head", PackedLinear(self.lm_head_weight))
        if screen_head and GreedyHead.serves(self.lm_head_weight, self.packed_head.kernel_weight):
            self._greedy_head = GreedyHead(self.lm_head_weight, self.packed_head.kernel_weight)
        self._pack_extra()
        pack_linears(self.layers)

    def _pack_extra(self) -> None:
        """Family-specific weights that are not nn.Linear (e.g. MoE expert banks)."""

    def _layer_args(self, meta: AttentionMetadata) -> tuple:
        """Extra per-forward arguments every decoder layer receives after (x, cos, sin, meta, cache)."""
        return ()

    def make_cache(self, num_rows: int, max_len: int, queries: int = 16) -> KVCache:
        """A cache of num_rows rows of max_len positions; queries: the most a row's step verifies (a hybrid target
        keeps its recurrent states after that many: engine/hybrid_cache.py)."""
        c = self.config
        p = self.embed_tokens.weight
        return KVCache(c.num_hidden_layers, num_rows, max_len, c.num_key_value_heads, c.head_dim, p.dtype, p.device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, Q]
        meta: AttentionMetadata,
        cache: KVCache,
        capture_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final-normed hidden [B, Q, H], captured [B, Q, H * len(capture_layer_ids)] or None).

        Layer l's capture is transformers' hidden_states[l + 1], what z-lab's drafters are trained on: its output after
        the residual add, and for the last layer after the final norm too.
        """
        return self.run_layers(self.embed_tokens(input_ids), meta, cache, 0, capture_layer_ids)

    def run_layers(
        self,
        x: torch.Tensor,  # [B, Q, H]: the embeddings (start 0) or decoder layer start - 1's output
        meta: AttentionMetadata,
        cache: KVCache,
        start: int = 0,
        capture_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder layers start.. then the final norm; forward's result when start is 0.

        A later start finishes the target from a captured layer output (train/teacher.py): the trainer's
        teacher logits cost the layers after the deepest feature, not a whole forward.
        """
        x, features = self._layers(x, meta, cache, start, len(self.layers), capture_layer_ids)
        return self.finish(x, features, capture_layer_ids)

    def finish(self, x: torch.Tensor, features: torch.Tensor | None,
               capture_layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last layer's output -> (final-normed hidden, the captures with the last layer's normed): transformers'
        last hidden_states entry is after the final norm."""
        normed = self.norm(x)
        last = len(self.layers) - 1
        if last in capture_layer_ids:
            h = x.shape[-1]
            features = torch.cat([normed if i == last else features[..., j * h:(j + 1) * h]
                                  for j, i in enumerate(capture_layer_ids)], dim=-1)
        return normed, features

    def capture(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: KVCache,
                capture_layer_ids: tuple[int, ...]) -> torch.Tensor:
        """forward's captured features alone [B, Q, H * len(capture_layer_ids)]: the layers after the deepest
        captured one and the final norm change no feature, so they do not run (a feature cache's build and the
        trainer's features on the fly: SmolLM2's [1, 8, 14, 20, 27] skip 2 of its 30 layers)."""
        x, features = self._layers(self.embed_tokens(input_ids), meta, cache, 0, max(capture_layer_ids) + 1,
                                   capture_layer_ids)
        if max(capture_layer_ids) == len(self.layers) - 1:
            features = self.finish(x, features, capture_layer_ids)[1]
        return features

    def _layers(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVCache, start: int, stop: int,
                capture_layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder layers start..stop - 1 -> (the last one's output, the captured layers' outputs or None)."""
        cos, sin = self.rotary(meta.rope_positions, x.dtype)
        extra = self._layer_args(meta)
        captured = {}
        wanted = set(capture_layer_ids)
        for i in range(start, stop):
            x = self.layers[i](x, cos, sin, meta, cache, *extra)
            if i in wanted:
                captured[i] = x
        features = torch.cat([captured[i] for i in capture_layer_ids], dim=-1) if capture_layer_ids else None
        return x, features

    def lm_head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output projection in the model dtype (shared with the drafter)."""
        if self.packed_head is not None:
            return self.packed_head(hidden)
        return F.linear(hidden, self.lm_head_weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head_forward(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1) without widening the logits to fp32 first: the widening is exact and
        monotone, so the argmax is the same (a decode step's ~0.07 ms on the CPU). Where the head's screen serves
        (up to GreedyHead.max_rows rows, 8, through the bf16 kernel) it chooses the same tokens reading about half the
        head."""
        if self._greedy_head is not None:
            tokens = self._greedy_head.argmax(hidden)
            if tokens is not None:
                return tokens
        return argmax_last(self.lm_head_forward(hidden))
