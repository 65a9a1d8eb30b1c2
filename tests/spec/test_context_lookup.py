"""Context lookup (spec/context_lookup.py): its incremental index against a search of the whole context, and its
scores against the acceptance it observed."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.spec.context_lookup import PRIOR_FIRST, PRIOR_NEXT, ContextLookup


def _search(tokens: list[int], max_len: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The definition: the longest suffix (max_ngram down to min_ngram tokens) that occurred earlier; the max_len
    tokens after its latest earlier occurrence in the tokens followed by the draft itself (a loop runs on)."""
    end = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[end - n :]:
                full = list(tokens)
                for i in range(max_len):
                    full.append(full[start + n + i])
                return full[end:]
    return []


@settings(max_examples=80, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), data=st.data())
def test_each_draft_is_the_latest_earlier_occurrence_of_the_longest_suffix(tokens, data):
    """Asked at growing lengths of one request (the index is incremental), every answer is the full search's."""
    max_ngram = data.draw(st.integers(1, 4))
    min_ngram = data.draw(st.integers(1, max_ngram))
    prompt_len = data.draw(st.integers(1, len(tokens)))
    lookup = ContextLookup(max_ngram, min_ngram)
    end = 0
    while end < len(tokens):
        end = min(len(tokens), end + data.draw(st.integers(1, 7)))
        lookup.extend(tokens[: min(end, prompt_len)], tokens[prompt_len:end])
        max_len = data.draw(st.integers(0, 8))
        assert lookup.draft(max_len) == _search(tokens[:end], max_len, max_ngram, min_ngram)


def _lookup(prompt: list[int], output: list[int] = ()) -> ContextLookup:
    lookup = ContextLookup()
    lookup.extend(prompt, list(output))
    return lookup


def test_a_summary_that_quotes_its_passage_drafts_the_rest_of_the_quote():
    passage = [5, 6, 7, 8, 9, 10, 11]
    answer = [1, 2, 6, 7]  # ... quoting "6 7" of the passage so far
    assert _lookup(passage + [3], answer).draft(4) == [8, 9, 10, 11]
    assert _lookup([5, 6, 7, 8]).draft(4) == []  # nothing repeats yet


def test_a_loop_drafts_on_through_its_period():
    assert _lookup([9], [7] * 9).draft(7) == [7] * 7
    assert _lookup([1, 2] * 3, [1, 2]).draft(5) == [1, 2, 1, 2, 1]


def test_the_ngram_bounds_are_checked():
    with pytest.raises(ValueError, match="min_ngram"):
        ContextLookup(2, 3)
    with pytest.raises(ValueError, match="min_ngram"):
        ContextLookup(2, 0)


def test_scores_start_at_the_prior_and_follow_what_the_target_accepted():
    """scored_draft: log P(accepted this deep), the prior before any step, never rising with depth; lookups the
    target keeps accepting score higher, lookups it keeps rejecting lower."""
    tokens = [1, 2, 3, 4, 5, 1, 2]  # "1 2" occurred before: the draft is 3 4 5 1 2
    fresh = _lookup(tokens).scored_draft(4)
    assert [t for t, _ in fresh] == [3, 4, 5, 1]
    assert fresh[0][1] == pytest.approx(math.log(PRIOR_FIRST))
    assert fresh[2][1] == pytest.approx(math.log(PRIOR_FIRST * PRIOR_NEXT**2))
    good, bad = _lookup(tokens), _lookup(tokens)
    for _ in range(20):
        good.observe(verified=4, accepted=4)
        bad.observe(verified=4, accepted=0)
    good_scores = [s for _, s in good.scored_draft(4)]
    bad_scores = [s for _, s in bad.scored_draft(4)]
    assert all(g > f[1] > b for g, f, b in zip(good_scores, fresh, bad_scores))
    assert good_scores[0] > math.log(0.8) and bad_scores[0] < math.log(0.1)
    assert good_scores == sorted(good_scores, reverse=True) and bad_scores == sorted(bad_scores, reverse=True)


def _predicting(prediction: list[int], prompt: list[int]) -> tuple[ContextLookup, callable]:
    """A lookup predicting its output, and a function that hands it the output so far and returns its draft."""
    lookup = ContextLookup(prediction=prediction)

    def draft(output: list[int], max_len: int = 4) -> list[int]:
        lookup.extend(prompt, output)
        return lookup.draft(max_len)
    return lookup, draft


def test_a_predicted_output_is_drafted_from_its_start_and_while_the_output_follows_it():
    """The output starts aligned with the prediction (whatever the prompt ends with), and drafts it from where the
    output has followed it to."""
    prediction = [20, 21, 22, 23, 24, 25, 26]
    _, draft = _predicting(prediction, [1, 2, 3])
    assert draft([]) == [20, 21, 22, 23]
    assert draft([20, 21]) == [22, 23, 24, 25]
    assert draft([20, 21, 22, 23, 24, 25], 4) == [26]
    assert draft([20, 21, 22, 23, 24, 25, 26], 4) == []  # followed to its end: the context has nothing either


def test_after_an_edit_the_prediction_is_drafted_again_from_where_the_output_rejoins_it():
    """A file rewritten with a change: past the changed tokens, the output's last tokens are found in the prediction
    at their first occurrence past where the output last followed it (not an earlier repeat), and drafted on from
    there; where they occur nowhere in it, the context's lookup drafts."""
    prediction = [30, 31, 7, 8, 40, 41, 42, 7, 8, 50, 51, 52]  # "7 8" twice
    _, draft = _predicting(prediction, [1, 2])
    assert draft([30, 31, 7, 8, 40]) == [41, 42, 7, 8]
    # 41 42 replaced by 60 61: no 2-gram of "40 60 61" is in the prediction, nor earlier in the context
    assert draft([30, 31, 7, 8, 40, 60, 61]) == []
    # the output rejoins it at "7 8": drafted from its second "7 8" (past the edit), not its first
    assert draft([30, 31, 7, 8, 40, 60, 61, 7, 8]) == [50, 51, 52]
    assert draft([30, 31, 7, 8, 40, 60, 61, 7, 8, 50]) == [51, 52]


def test_an_output_that_never_follows_its_prediction_drafts_from_its_context():
    _, draft = _predicting([70, 71, 72], [5, 6, 7, 8, 9])
    assert draft([1, 6, 7]) == [8, 9, 1, 6]  # the context's lookup, as without a prediction
    assert _lookup([5, 6, 7, 8, 9], [1, 6, 7]).draft(4) == [8, 9, 1, 6]


def test_an_edit_rejoins_the_prediction_past_what_the_output_followed_step_by_step():
    """Where the output left the prediction is counted as it follows it, token by token, not as drafts were asked
    for: an edit after a repeated n-gram the output followed past rejoins at its next occurrence."""
    prediction = [30, 31, 7, 8, 40, 41, 42, 43, 44, 7, 8, 50, 51, 52]
    lookup, draft = _predicting(prediction, [1, 2])
    assert draft([30]) == [31, 7, 8, 40]
    assert draft([30, 31, 7, 8, 40, 41, 42, 43, 44, 99, 7, 8], 3) == [50, 51, 52]
