"""RotaryEmbedding's CPU table gives, bit for bit, the cos/sin of the reference formula at any positions."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.layers.rotary import RotaryEmbedding, rope_inv_freq


def reference(positions, inv_freq, scaling, dtype):
    freqs = positions.float()[..., None] * inv_freq  # Llama's neox layout: the frequencies twice
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype)[:, None], (emb.sin() * scaling).to(dtype)[:, None]


@settings(max_examples=40, deadline=None)
@given(
    rope=st.sampled_from([{"rope_theta": 100000.0}, {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0},
                          {"rope_theta": 150000.0, "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    calls=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(0, 5000)), min_size=1, max_size=4),
)
def test_table_equals_the_formula(rope, dtype, calls):
    rotary = RotaryEmbedding(64, rope, 8192)
    inv_freq, scaling = rope_inv_freq(64, rope, 8192)
    for rows, steps, start in calls:  # later calls may need the table grown past 1,024 positions
        positions = start + torch.arange(rows * steps).view(rows, steps)
        cos, sin = rotary(positions, dtype)
        want_cos, want_sin = reference(positions, inv_freq, scaling, dtype)
        assert cos.shape == want_cos.shape == (rows, 1, steps, 64)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
