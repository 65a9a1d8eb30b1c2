"""OpenAI's predicted outputs (`prediction: {"type": "content", "content": ...}`, text parts joined as written): text
the answer is expected to repeat much of (a file it rewrites with a few changes), at most the context's length. The
engine drafts it where the answer follows it (spec/context_lookup.py): the answer is the target's own whatever it
predicts, and comes sooner the more of it it repeats. Usage says how many of its tokens the answer repeated and how
many it did not, OpenAI's two counts (the answer's tokens, its reasoning's and its stop token too, are compared;
unlike OpenAI, rejected tokens are not billed as completion tokens: completion_tokens counts the answer's own).
"""

from __future__ import annotations

from difflib import SequenceMatcher


def prediction_tokens(prediction: list[int], output: list[int]) -> tuple[int, int]:
    """(accepted_prediction_tokens, rejected_prediction_tokens): the prediction's tokens that appear in the output, in
    order (the longest matching blocks, as a diff finds them), and the rest of them."""
    matcher = SequenceMatcher(None, prediction, output, autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted
