"""The on-disk feature cache: the target's hidden states, resumable and extendable."""

import json
import logging

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_trt.models.registry import load_target
from dflash_trt.train.feature_cache import FeatureCache, build_feature_cache
from tests.conftest import make_target


def _sequences(n: int) -> list[tuple[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [(f"{i}:greedy", torch.randint(3, 90, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g).tolist())
            for i in range(n)]


def _assert_layers_0_and_1_of_transformers(cache, seqs, path, atol: float, rtol: float) -> None:
    """The cached features are transformers' fp32 hidden states after layers 0 and 1, stored in fp16."""
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    for sid, ids in seqs:
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want = torch.cat([hs[1], hs[2]], dim=-1)[0].to(torch.float16).numpy()
        np.testing.assert_allclose(np.asarray(cache.get(sid), dtype=np.float32), want.astype(np.float32),
                                   atol=atol, rtol=rtol)


def test_appended_sequences_are_added_without_touching_cached_shards(tmp_path):
    path = make_target(tmp_path / "target", layers=3, seed=4)  # ids 0 and 1: HF applies the final norm to its last hidden state
    target = load_target(path)
    seqs = _sequences(12)
    build_feature_cache(target, seqs[:7], tmp_path / "cache", [0, 1], shard_tokens=40)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("shard_*.npy")}
    cache = build_feature_cache(target, seqs, tmp_path / "cache", [0, 1], shard_tokens=40)
    assert all((tmp_path / "cache" / n).stat().st_mtime_ns == t for n, t in before.items())
    assert sorted(cache.ids()) == sorted(sid for sid, _ in seqs)

    _assert_layers_0_and_1_of_transformers(cache, seqs, path, atol=2e-3, rtol=2e-3)


def test_ctrl_c_keeps_the_features_of_a_shard_computed_so_far_and_a_resume_computes_only_the_rest(tmp_path,
                                                                                                    monkeypatch):
    import dflash_trt.train.feature_cache as feature_cache

    path = make_target(tmp_path / "target", layers=3, seed=4)
    target = load_target(path)
    seqs = _sequences(10)
    real, batches = feature_cache._features, []

    def interrupted_at_the_third_batch(model, id_lists, cache, layer_ids):
        batches.append(len(id_lists))
        if len(batches) == 3:
            raise KeyboardInterrupt
        return real(model, id_lists, cache, layer_ids)

    monkeypatch.setattr(feature_cache, "_features", interrupted_at_the_third_batch)
    with pytest.raises(KeyboardInterrupt):
        build_feature_cache(target, seqs, tmp_path / "cache", [0, 1], shard_tokens=10_000, batch_rows=2)
    kept = FeatureCache(tmp_path / "cache")
    assert len(kept.ids()) == 4  # the first two batches' sequences, in one shard of their own
    monkeypatch.setattr(feature_cache, "_features", real)
    computed = []
    monkeypatch.setattr(feature_cache, "_features",
                        lambda model, id_lists, *a: computed.extend(id_lists) or real(model, id_lists, *a))
    cache = build_feature_cache(target, seqs, tmp_path / "cache", [0, 1], shard_tokens=10_000, batch_rows=2)
    assert len(computed) == 6 and sorted(cache.ids()) == sorted(sid for sid, _ in seqs)
    _assert_layers_0_and_1_of_transformers(cache, seqs, path, atol=2e-3, rtol=2e-3)


def test_a_sequence_cached_shorter_is_cached_again_in_full(tmp_path):
    path = make_target(tmp_path / "target", layers=2, seed=5)
    target = load_target(path)
    seqs = _sequences(3)
    build_feature_cache(target, [(sid, ids[:4]) for sid, ids in seqs], tmp_path / "cache", [0], shard_tokens=40)
    first = (tmp_path / "cache" / "shard_00000.npy").read_bytes()
    cache = build_feature_cache(target, seqs, tmp_path / "cache", [0], shard_tokens=40)
    assert [cache.get(sid).shape[0] for sid, _ in seqs] == [len(ids) for _, ids in seqs]
    assert (tmp_path / "cache" / "shard_00000.npy").read_bytes() == first  # kept, never overwritten


def test_a_record_whose_tokens_changed_is_cached_again_from_its_new_tokens(tmp_path, caplog):
    """Record ids are positions in responses.jsonl: generated again into the same --data, an id names other tokens,
    and its cached features must not be trained on."""
    path = make_target(tmp_path / "target", layers=3, seed=4)
    target = load_target(path)
    seqs = _sequences(5)
    build_feature_cache(target, seqs, tmp_path / "cache", [0, 1], shard_tokens=40)
    changed = [(sid, ids if i % 2 else [(t + 7) % 90 + 3 for t in ids]) for i, (sid, ids) in enumerate(seqs)]
    with caplog.at_level(logging.WARNING):
        cache = build_feature_cache(target, changed, tmp_path / "cache", [0, 1], shard_tokens=40)
    assert "3 cached sequences were computed from other tokens" in caplog.text
    for sid, ids in changed:
        assert cache.tokens(sid).tolist() == ids
    _assert_layers_0_and_1_of_transformers(cache, changed, path, atol=2e-3, rtol=2e-3)
    FeatureCache(tmp_path / "cache")  # what is on disk now reads back the same way
    assert all(FeatureCache(tmp_path / "cache").holds(sid, ids) for sid, ids in changed)


def test_a_shorter_prefix_of_a_cached_sequence_is_served_from_the_cache(tmp_path):
    """max_seq_len lowered: the same records cut shorter need nothing new."""
    target = load_target(make_target(tmp_path / "target", layers=2, seed=5))
    seqs = _sequences(4)
    whole = build_feature_cache(target, seqs, tmp_path / "cache", [0], shard_tokens=40)
    shards = sorted(p.name for p in (tmp_path / "cache").iterdir())
    cut = build_feature_cache(target, [(sid, ids[:4]) for sid, ids in seqs], tmp_path / "cache", [0],
                              compute_with=lambda: pytest.fail("nothing is missing"))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == shards
    for sid, _ in seqs:
        assert np.array_equal(cut.get(sid), whole.get(sid))


def test_a_cache_of_other_layers_is_refused_naming_the_data_option(tmp_path):
    target = load_target(make_target(tmp_path / "target", layers=2, seed=5))
    build_feature_cache(target, _sequences(2), tmp_path / "cache", [0])
    with pytest.raises(ValueError, match=r"target_layer_ids=\[0\] differ from \[1\]; use another --data directory"):
        build_feature_cache(target, _sequences(2), tmp_path / "cache", [1])


@pytest.mark.parametrize("damage", ["truncated", "missing", "other width", "token ids missing", "no token ids"])
def test_a_damaged_shard_is_named_and_its_sequences_cached_again(tmp_path, caplog, damage):
    target = load_target(make_target(tmp_path / "target", layers=2, seed=5))
    seqs = _sequences(6)
    whole = build_feature_cache(target, seqs, tmp_path / "cache", [0], shard_tokens=40)
    want = {sid: np.array(whole.get(sid)) for sid, _ in seqs}
    shard = tmp_path / "cache" / "shard_00000.npy"
    lost = sorted(json.loads((tmp_path / "cache" / "index.json").read_text())["shards"][0]["sequences"])
    if damage == "truncated":  # a copy cut short
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "missing":
        shard.unlink()
    elif damage == "other width":
        np.save(shard, np.zeros((4, 3), dtype=np.float16))
    elif damage == "token ids missing":
        (tmp_path / "cache" / "shard_00000.tokens.npy").unlink()
    else:  # a cache written before token ids were stored
        index = json.loads((tmp_path / "cache" / "index.json").read_text())
        del index["shards"][0]["tokens"]
        (tmp_path / "cache" / "index.json").write_text(json.dumps(index))
    # Found when the cache is opened, not when a training step first reads the shard.
    with pytest.raises(ValueError, match=f"{shard}: .*build_feature_cache caches its sequences again"):
        FeatureCache(tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        cache = build_feature_cache(target, seqs, tmp_path / "cache", [0], shard_tokens=40)
    assert f"{shard}: " in caplog.text and f"its {len(lost)} sequences are cached again" in caplog.text
    for sid, _ in seqs:
        np.testing.assert_array_equal(np.asarray(cache.get(sid)), want[sid])
    FeatureCache(tmp_path / "cache")  # whole again


def test_a_damaged_index_or_another_targets_cache_is_refused_naming_the_file(tmp_path):
    target = load_target(make_target(tmp_path / "target", layers=2, seed=5))
    build_feature_cache(target, _sequences(2), tmp_path / "cache", [0])
    wider = load_target(make_target(tmp_path / "wider", layers=2, seed=5, hidden_size=48))
    index = tmp_path / "cache" / "index.json"
    with pytest.raises(ValueError, match=f"{index}: cached features are 64 wide, this target's layers give 48"):
        build_feature_cache(wider, _sequences(2), tmp_path / "cache", [0])
    whole = json.loads(index.read_text())
    # cut short; a shard entry without its sequences, shards not a list (a KeyError or TypeError traceback)
    for damaged in (index.read_text()[:20], json.dumps({**whole, "shards": [{"file": "x.npy"}]}),
                    json.dumps({**whole, "shards": "oops"})):
        index.write_text(damaged)
        with pytest.raises(ValueError, match=f"{index} is damaged .*: delete {tmp_path / 'cache'}"):
            build_feature_cache(target, _sequences(2), tmp_path / "cache", [0])


@pytest.mark.parametrize("native", [False, True])
def test_features_of_a_bf16_target_are_computed_in_fp32_where_the_cpu_emulates_bf16(tmp_path, monkeypatch, native):
    """Without native bf16 the cache is built by the target's fp32 twin: the features are transformers' fp32 hidden
    states to fp16 storage precision (bf16 compute is ~20x further off); with it, by the target itself."""
    from dflash_trt.train import cli

    monkeypatch.setattr("dflash_trt.hardware.native_bf16", lambda device_type: native)
    path = make_target(tmp_path / "target", layers=3, seed=4)
    target = load_target(path, torch.bfloat16)
    twin = cli.feature_target(target, path)
    assert (twin is target) is native
    if native:
        return
    assert twin.embed_tokens.weight.dtype == torch.float32
    seqs = _sequences(4)
    cache = build_feature_cache(twin, seqs, tmp_path / "cache", [0, 1], shard_tokens=40)
    _assert_layers_0_and_1_of_transformers(cache, seqs, path, atol=1e-4, rtol=1e-3)


def test_the_computing_model_is_loaded_only_when_features_are_missing(tmp_path):
    path = make_target(tmp_path / "target", layers=2, seed=5)
    target = load_target(path, torch.float32)
    seqs = _sequences(3)
    loads = []

    def load():
        loads.append(1)
        return target

    whole = build_feature_cache(target, seqs, tmp_path / "cache", [0], shard_tokens=40, compute_with=load)
    assert loads == [1]
    again = build_feature_cache(target, seqs, tmp_path / "cache", [0], shard_tokens=40, compute_with=load)
    assert loads == [1]  # complete: a resume loads nothing
    for sid, _ in seqs:
        assert np.array_equal(again.get(sid), whole.get(sid))
