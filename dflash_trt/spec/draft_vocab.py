"""A draft vocabulary: the drafter proposes only among the tokens the target emitted most in its training data.

The drafter shares the target's output head. At batch 1 on a CPU, SmolLM2's 49,152 x 576 bf16 head (57 MB) is
read once per draft step, as much again as a fifth of the target's weights. A head restricted to the N most
frequent tokens of the training responses (frequency-ranked drafting, as FR-Spec and EAGLE-3's d2t do) reads N
rows instead. A token outside the set is never drafted, so acceptance drops only where the target picks one.
Verification still runs over the whole vocabulary, so output is lossless either way: a sampled draft comes from
the distribution renormalised over the set, and that is the proposal the rejection rule is given.

File: draft_vocab.json beside the drafter's model.safetensors, {"token_ids": [most frequent first], "counts": [...]}.
Not a .safetensors file: vLLM loads every *.safetensors in a drafter directory as weights and fails on unknown
tensors. z-lab's dflash, vLLM and TensorRT-LLM load the drafter without it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.layers.linear import PackedLinear, can_pack

FILE = "draft_vocab.json"


def rank_tokens(token_lists: Iterable[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token that occurs, most frequent first (ties by id) -> (token_ids, counts)."""
    counts = Counter(t for tokens in token_lists for t in tokens)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return (torch.tensor([t for t, _ in ranked], dtype=torch.long),
            torch.tensor([c for _, c in ranked], dtype=torch.long))


def save_draft_vocab(drafter_dir: str | Path, token_ids: torch.Tensor, counts: torch.Tensor) -> Path:
    path = Path(drafter_dir) / FILE
    path.write_text(json.dumps({"token_ids": token_ids.tolist(), "counts": counts.tolist()}) + "\n")
    return path


def cut_draft_vocab(token_ids: torch.Tensor | None, size: int | None, key: str = "draft_vocab_size",
                    drafter: str = "the drafter") -> torch.Tensor | None:
    """The tokens to draft among: the `size` most frequent of a drafter's ranked `token_ids` (None when it ships
    no draft_vocab.json); size None: all it lists; 0: the whole vocabulary (None). Errors name `key`."""
    if size == 0:
        return None
    if size is None:
        return token_ids
    if token_ids is None:
        raise ValueError(f"{key}={size} needs a drafter that ships draft_vocab.json (dflash-trt train writes one); "
                         f"{drafter} has none")
    if size > token_ids.numel():
        raise ValueError(f"{key}={size} exceeds the {token_ids.numel()} tokens {drafter}'s draft_vocab.json lists")
    return token_ids[:size]


def load_draft_vocab(drafter_dir: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The ranked token ids the drafter ships, or None when it ships none."""
    path = Path(drafter_dir) / FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    ids = data.get("token_ids") if isinstance(data, dict) else None
    if ids is None:
        raise ValueError(f"{path}: no key 'token_ids' (has {sorted(data) if isinstance(data, dict) else type(data).__name__})")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{path}: 'token_ids' must be a non-empty list of integers")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"{path}: 'token_ids' holds ids outside the target's vocabulary [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: 'token_ids' repeats ids")
    return torch.tensor(ids, dtype=torch.long)


class DraftHead(nn.Module):
    """The target's output head restricted to token_ids: hidden [..., H] -> logits [..., N]."""

    def __init__(self, lm_head_weight: torch.Tensor, token_ids: torch.Tensor, pack: bool = True) -> None:
        super().__init__()
        self.token_ids = token_ids.to(lm_head_weight.device)
        weight = lm_head_weight.detach().index_select(0, self.token_ids)
        self.packed = PackedLinear(weight) if pack and can_pack(weight) else None
        self.weight = None if self.packed is not None else weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.packed(hidden) if self.packed is not None else F.linear(hidden, self.weight)
