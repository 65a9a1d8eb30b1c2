"""OpenAI's predicted outputs (`prediction: {"type": "content", "content": ...}`): text the answer is expected to repeat
much of (a file it rewrites with a few changes). The engine drafts it where the answer follows it
(spec/context_lookup.py): the answer is the target's own whatever it predicts, and comes sooner the more of it it
repeats. Usage says how much of it the answer repeated, as OpenAI counts it.
"""

from __future__ import annotations

from difflib import SequenceMatcher


def prediction_tokens(prediction: list[int], output: list[int]) -> tuple[int, int]:
    """(accepted_prediction_tokens, rejected_prediction_tokens): the prediction's tokens that appear in the output, in
    order (the longest matching blocks, as a diff finds them), and the rest of them."""
    matcher = SequenceMatcher(None, prediction, output, autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted
