"""DFlashProposer: one drafter forward per step proposes K tokens for every row.

Worked example (one row, K = 3): the target has committed 10 tokens (positions 0..9) and the anchor
(the last bonus token) sits at position 10. The features of the tokens committed since the last
step, say positions 7..9, are injected into the drafter cache at 7..9; the block
[anchor, MASK, MASK, MASK] runs at positions 10..13 and sees cache keys [0, 14); its outputs at block
slots 1..3 predict the tokens at positions 11..13.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dflash_trt.layers.attention import AttentionMetadata, HostRows
from dflash_trt.layers.sampler import known_flags, sample_from, sampling_probs, uniform
from dflash_trt.models.dflash import DFlashDrafter
from dflash_trt.spec.draft_tree import DraftTree, build_tree, max_nodes
from dflash_trt.spec.draft_vocab import DraftHead


class DraftGrammar(Protocol):
    def allowed_after(self, drafts: Sequence[int]) -> torch.Tensor:
        """bool [V]: the tokens a request's grammar allows after its committed tokens and these drafts."""

    def allows(self, drafts: Sequence[int], token: int) -> bool:
        """Whether it takes token after these drafts."""


@dataclass
class DraftSampling:
    """Rows that sample their drafts (the "rejection" rule); every other row drafts the argmax."""

    rows: torch.Tensor  # [R] indices into the batch
    temperature: torch.Tensor  # [R]
    top_k: torch.Tensor  # [R]
    top_p: torch.Tensor  # [R]
    generators: list[torch.Generator]
    settings: tuple[list[float], list[int], list[float]]  # temperature, top-k, top-p on the host


@dataclass
class Proposal:
    draft_tokens: torch.Tensor  # [B, K]
    draft_probs: torch.Tensor | None  # [R, K, V] for DraftSampling.rows, else None
    draft_logprobs: torch.Tensor | None = None  # [B, K] each argmax draft's log-probability, where asked for


class DFlashProposer:
    def __init__(
        self,
        drafter: DFlashDrafter,
        embed_weight: torch.Tensor,  # the target's input embedding [V, H], shared and frozen
        lm_head: Callable[[torch.Tensor], torch.Tensor],  # the target's output head, shared and frozen
        num_rows: int,
        max_len: int,
        lm_head_weight: torch.Tensor | None = None,  # [V, H]; needed with draft_vocab
        draft_vocab: torch.Tensor | None = None,  # token ids to draft among (spec/draft_vocab.py); None: all
        pack_head: bool = True,  # prepack the restricted head on the CPU (EngineConfig.pack_weights)
    ) -> None:
        self.drafter = drafter
        self.embed_weight = embed_weight
        self.lm_head = lm_head
        self.draft_vocab = None
        if draft_vocab is not None:
            if lm_head_weight is None:
                raise ValueError("a draft vocabulary needs the target's output head weight (lm_head_weight)")
            self.lm_head = DraftHead(lm_head_weight, draft_vocab, pack_head)
            self.draft_vocab = self.lm_head.token_ids
        cfg = drafter.config
        self.mask_token_id = cfg.mask_token_id
        self.max_draft_len = cfg.block_size - 1
        # Room for a block past the last context position, and for padded ragged context writes.
        self.cache = drafter.make_cache(num_rows, max_len + cfg.block_size + 1)

    @torch.inference_mode()
    def propose(
        self,
        rows: torch.Tensor,  # [B] cache rows
        features: torch.Tensor,  # [B, N, H * n_features] target features of newly committed tokens
        context: AttentionMetadata | None,  # where they go in the cache ([B, N]; padded entries at or past the anchor)
        anchors: torch.Tensor,  # [B] the last committed token of each row (not yet seen by the target)
        anchor_positions: torch.Tensor,  # [B]
        num_draft: int,
        sampling: DraftSampling | None = None,
        with_logprobs: bool = False,
        host: HostRows | None = None,  # the rows and anchor positions on the host (layers/attention.py)
        grammars: dict[int, DraftGrammar] | None = None,  # rows that draft the argmax of what their grammar allows
    ) -> Proposal:
        logits = self._slot_logits(rows, features, context, anchors, anchor_positions, num_draft, host)
        for i, grammar in (grammars or {}).items():
            logits[i] = self._within(grammar, logits[i])
        draft_tokens = logits.argmax(dim=-1)  # indices into the draft vocabulary when there is one
        logprobs = None
        if with_logprobs:  # before sampled rows replace their argmax: theirs are not argmax drafts
            logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, draft_tokens[..., None])[..., 0]
        draft_probs = None
        if sampling is not None and sampling.rows.numel():
            draft_probs = sampling_probs(logits[sampling.rows], sampling.temperature, sampling.top_k, sampling.top_p,
                                         **known_flags(*sampling.settings, logits.shape[-1]))
            u = uniform(sampling.generators, num_draft, logits.device)
            draft_tokens[sampling.rows] = sample_from(draft_probs, u)
        if self.draft_vocab is not None:
            draft_tokens = self.draft_vocab[draft_tokens]
            if draft_probs is not None:  # the proposal over the whole vocabulary: zero outside the set
                full = draft_probs.new_zeros(*draft_probs.shape[:-1], self.embed_weight.shape[0])
                draft_probs = full.index_copy_(-1, self.draft_vocab, draft_probs)
        return Proposal(draft_tokens, draft_probs, logprobs)

    @torch.inference_mode()
    def propose_tree(
        self,
        rows: torch.Tensor,
        features: torch.Tensor,
        context: AttentionMetadata | None,
        anchors: torch.Tensor,
        anchor_positions: torch.Tensor,
        depth: int,
        nodes: int,
        branches: list[list[tuple[int, float]]] | None = None,
        width: int = 4,
        host: HostRows | None = None,
        grammars: dict[int, DraftGrammar] | None = None,
    ) -> DraftTree:
        """One drafter forward over [anchor, MASK x depth] as in propose(); then per row the `nodes` likeliest of
        the paths through each slot's `width` most likely tokens and of the prefixes of the row's branch, where
        given (spec/draft_tree.py build_tree); a grammar row's slots as propose() masks them."""
        logits = self._slot_logits(rows, features, context, anchors, anchor_positions, depth, host)
        for i, grammar in (grammars or {}).items():
            logits[i] = self._within(grammar, logits[i])
        width = min(width, nodes, logits.shape[-1])
        top = torch.log_softmax(logits.float(), dim=-1).topk(width, dim=-1)
        tokens = top.indices if self.draft_vocab is None else self.draft_vocab[top.indices]
        # a shallow block (the scheduler shortens K near a request's end) holds fewer paths
        return build_tree(anchors, tokens, top.values, min(nodes, max_nodes(depth, width)), branches)

    def _within(self, grammar: DraftGrammar, logits: torch.Tensor) -> torch.Tensor:
        """One row's slot logits [K, V] with each slot's tokens the grammar refuses after the chain of the slots'
        argmaxes before it masked out, so its chain drafts only what the grammar allows (a refused draft would be
        rejected anyway), and a tree's first slot and its chain of top tokens too; past a slot where the grammar allows
        none of the drafter's tokens, the logits as they are. Past the first slot (whose alternatives a tree drafts), a
        slot whose argmax the grammar takes keeps its logits: a whole mask costs ~0.1 ms, a check a few us."""
        chosen: list[int] = []
        out = logits.clone()
        top_ids = logits.argmax(dim=-1).tolist()
        for j, top in enumerate(top_ids):
            token = top if self.draft_vocab is None else int(self.draft_vocab[top])
            if j and grammar.allows(chosen, token):
                chosen.append(token)
                continue
            allowed = grammar.allowed_after(chosen).to(logits.device)
            if self.draft_vocab is not None:
                allowed = allowed[self.draft_vocab]
            if not bool(allowed.any()):
                break
            out[j] = logits[j].masked_fill(~allowed, -torch.inf)
            top = int(out[j].argmax())
            chosen.append(top if self.draft_vocab is None else int(self.draft_vocab[top]))
        return out

    def _slot_logits(self, rows, features, context, anchors, anchor_positions, num_draft, host=None) -> torch.Tensor:
        """The drafter's step: [B, num_draft, V] logits of block slots 1..num_draft (over the draft vocabulary
        when there is one)."""
        if not 1 <= num_draft <= self.max_draft_len:
            raise ValueError(
                f"max_draft_len={num_draft} must be in 1..{self.max_draft_len} (drafter block_size={self.max_draft_len + 1})"
            )
        d = self.drafter
        offsets = torch.arange(num_draft + 1, device=anchors.device)
        positions = anchor_positions[:, None] + offsets  # [B, K + 1]
        block = torch.full_like(positions, self.mask_token_id)
        block[:, 0] = anchors
        meta = AttentionMetadata.block_step(rows, positions, anchor_positions + num_draft + 1, host)
        embeds = F.embedding(block, self.embed_weight)
        if d.config.input_embedding_scale != 1.0:
            embeds = embeds * d.config.input_embedding_scale
        hidden = d.draft(features, context, embeds, meta, self.cache)
        return d.compute_logits(hidden[:, 1:], self.lm_head)  # slot j predicts position anchor + j
