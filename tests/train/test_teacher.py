"""The teacher's logits are the target's own, from the deepest captured layer on."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_trt.models.registry import load_target
from dflash_trt.train.feature_cache import TargetFeatures
from dflash_trt.train.teacher import Teacher, distill_loss
from tests.conftest import make_target


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_teacher_logits_are_the_targets_next_token_logits(tmp_path, arch):
    """Also for a hybrid target (Qwen3.5): its features of two sequences padded into one batch, and the layers after
    the deepest feature run from a fresh recurrent state."""
    if arch == "qwen3_5":
        from tests.models.test_qwen3_5 import make_qwen3_5

        t = make_qwen3_5(tmp_path / "target", seed=3)
    else:
        t = make_target(tmp_path / "target", arch=arch, layers=4, seed=3)
    target = load_target(t)
    hf = AutoModelForCausalLM.from_pretrained(t).eval()
    seqs = [list(range(5, 30)), list(range(40, 52))]
    recs = [{"prompt_ids": s[:3], "response_ids": s[3:]} for s in seqs]
    rows_of_head = torch.tensor([7, 3, 60, 11, 42])
    for layer_ids in ([1, 2], [0, 3]):  # layers after the deepest feature run; none after the last layer
        feats = TargetFeatures(target, layer_ids).batch(recs, [len(s) for s in seqs])
        teacher = Teacher(target, layer_ids, target.lm_head_weight[rows_of_head])
        rows, positions = torch.tensor([0, 0, 1, 1, 0]), torch.tensor([0, 24, 11, 4, 13])
        got = teacher.logits(feats, rows, positions)
        with torch.no_grad():
            want = torch.stack([hf(torch.tensor([seqs[r]])).logits[0, p, rows_of_head] for r, p in zip(rows, positions)])
        assert got.shape == (5, 5) and torch.allclose(got, want, atol=1e-4)


def test_distill_loss_is_the_kl_from_teacher_to_student():
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 9, generator=gen), torch.randn(6, 9, generator=gen) * 3
    want = torch.nn.functional.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), log_target=True,
                                      reduction="none").sum(-1)
    assert torch.allclose(distill_loss(student, teacher), want, atol=1e-6)
    assert torch.allclose(distill_loss(teacher + 5.0, teacher), torch.zeros(6), atol=1e-5)  # a shift is no change
