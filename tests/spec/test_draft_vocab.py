"""The draft vocabulary: ranked from data, stored beside the drafter, and drafting exactly the full head's argmax
restricted to its tokens (the lossless contract with it lives in tests/engine/test_lossless.py)."""

import pytest
import torch

from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.layers.attention import AttentionMetadata
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.registry import load_target
from dflash_trt.spec.draft_vocab import FILE, load_draft_vocab, rank_tokens, save_draft_vocab
from dflash_trt.spec.proposer import DFlashProposer

pytest.importorskip("dflash.model", reason="the tiny drafters are built with z-lab's dflash==0.1.0")


def test_tokens_are_ranked_by_count_then_id():
    ids, counts = rank_tokens([[5, 3, 5, 9], [3, 5, 7], [9]])
    assert ids.tolist() == [5, 3, 9, 7] and counts.tolist() == [3, 2, 2, 1]


def test_the_file_round_trips(tmp_path):
    save_draft_vocab(tmp_path, torch.tensor([4, 1, 2]), torch.tensor([9, 5, 5]))
    assert load_draft_vocab(tmp_path, vocab_size=8).tolist() == [4, 1, 2]
    assert load_draft_vocab(tmp_path / "elsewhere", vocab_size=8) is None
    with pytest.raises(ValueError, match=f"{FILE}.*outside the target's vocabulary"):
        load_draft_vocab(tmp_path, vocab_size=4)


@pytest.mark.parametrize("content, message", [
    ('{"token_ids": [1, 1]}', "repeats ids"),
    ('{"ids": [1]}', f"{FILE}.*no key 'token_ids'"),
    ('{"token_ids": [1, 2.5]}', "non-empty list of integers"),
    ('{"token_ids": [1,', f"{FILE}: not valid JSON"),
])
def test_a_bad_file_is_refused_naming_the_file_and_key(tmp_path, content, message):
    (tmp_path / FILE).write_text(content)
    with pytest.raises(ValueError, match=message):
        load_draft_vocab(tmp_path, vocab_size=8)


def _drafts(tiny_dirs, vocab, k=7, head_logits: list | None = None):
    """The drafts of a fixed batch; `head_logits` collects the target head's logits over the whole vocabulary where
    the proposer drafts among all of it."""
    target = load_target(tiny_dirs["qwen3"])
    drafter = load_drafter(tiny_dirs["qwen3_drafter"], target.config)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 90, (4, 12), generator=g)
    rows = torch.arange(4)
    meta = AttentionMetadata.causal_step(rows, torch.arange(12).expand(4, 12))
    _, features = target(ids, meta, target.make_cache(4, 64), tuple(drafter.config.target_layer_ids))
    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = target.lm_head_forward(hidden)
        if head_logits is not None:
            head_logits.append(logits)
        return logits

    proposer = DFlashProposer(drafter, target.embed_tokens.weight, head, 4, 64, target.lm_head_weight, vocab)
    anchors = torch.randint(3, 90, (4,), generator=g)
    return proposer.propose(rows, features, meta, anchors, torch.full((4,), 12), k).draft_tokens


def test_drafts_are_the_full_heads_argmax_restricted_to_the_vocabulary(tiny_dirs):
    vocab_size = load_target(tiny_dirs["qwen3"]).config.vocab_size
    logits = []
    full = _drafts(tiny_dirs, None, head_logits=logits)
    (logits,) = logits  # [4, K, V]: one drafter forward drafts the whole block
    everything = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_drafts(tiny_dirs, everything), full)  # any order of every token: the same drafts
    subset = torch.cat([full[0, :3].unique(), torch.arange(40, 70)]).unique()  # keeps some argmaxes, drops others
    restricted = _drafts(tiny_dirs, subset)
    inside = torch.isin(full, subset)
    assert inside.any() and not inside.all()
    assert torch.isin(restricted, subset).all()
    assert torch.equal(restricted[inside], full[inside])  # the argmax over the set is the set's best token
    # and where the full argmax falls outside the set, the set's best token by the full head's logits
    assert torch.equal(restricted, subset[logits[..., subset].argmax(-1)])


def test_the_engine_takes_the_n_most_frequent_tokens_or_none(tiny_dirs):
    target = load_target(tiny_dirs["qwen3"])
    drafter = load_drafter(tiny_dirs["qwen3_drafter"], target.config)
    with pytest.raises(ValueError, match="draft_vocab_size=5 needs a drafter that ships draft_vocab.json"):
        LLMEngine(target, None, drafter, EngineConfig(max_batch_size=1, draft_vocab_size=5))
    drafter.draft_vocab = torch.tensor([9, 4, 7, 1])
    assert LLMEngine(target, None, drafter, EngineConfig(max_batch_size=1, draft_vocab_size=2)
                     ).runner.proposer.draft_vocab.tolist() == [9, 4]
    assert LLMEngine(target, None, drafter, EngineConfig(max_batch_size=1, draft_vocab_size=0)).runner.proposer.draft_vocab is None
    assert LLMEngine(target, None, drafter, EngineConfig(max_batch_size=1)).runner.proposer.draft_vocab.numel() == 4
    with pytest.raises(ValueError, match="draft_vocab_size=5 exceeds the 4 tokens"):
        LLMEngine(target, None, drafter, EngineConfig(max_batch_size=1, draft_vocab_size=5))
