"""Fixtures the engine's sampling tests share."""

import pytest

from tests.conftest import make_drafter, make_target

V = 4  # 4 new tokens over a 4-token vocabulary: 256 outcomes, enumerated exactly


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_vocab")
    t = make_target(root / "t", vocab=V, seed=11)
    d = make_drafter(root / "d", t, block_size=8, target_layer_ids=(1, 3), seed=12)
    return t, d
