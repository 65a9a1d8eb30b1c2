"""Predicted outputs' usage (server/prediction.py): the prediction's tokens the answer repeated, and the rest."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.server.prediction import prediction_tokens


def _lcs(a: list[int], b: list[int]) -> int:
    """The longest common subsequence's length (the most of a that b can repeat in order)."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev, row = row, [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
    return row[-1]


@settings(max_examples=200, deadline=None)
@given(prediction=st.lists(st.integers(0, 5), max_size=30), output=st.lists(st.integers(0, 5), max_size=30))
def test_accepted_tokens_are_a_common_subsequence_and_the_rest_are_rejected(prediction, output):
    accepted, rejected = prediction_tokens(prediction, output)
    assert accepted + rejected == len(prediction) and 0 <= accepted <= _lcs(prediction, output)


def test_a_repeated_prediction_is_accepted_whole_and_an_edit_is_rejected():
    file = list(range(10, 40))
    assert prediction_tokens(file, file) == (30, 0)
    assert prediction_tokens(file, file[:10] + [1, 2] + file[10:]) == (30, 0)  # the answer added two tokens
    assert prediction_tokens(file, file[:10] + [1, 2, 3] + file[13:]) == (27, 3)  # it changed three
    assert prediction_tokens(file, [1, 2, 3]) == (0, 30)
