"""How many forwards a model ran, and how wide: what a test of shared or skipped prefill counts."""

from __future__ import annotations

import pytest
import torch


def record_forward_widths(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that fills with the query width of each forward of `model` from now on (a prefill chunk is bucketed to a
    multiple of 16 tokens, a verify block is K + 1 wide, a plain decode step 1)."""
    widths: list[int] = []
    forward = model.forward

    def counted(ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    return widths
