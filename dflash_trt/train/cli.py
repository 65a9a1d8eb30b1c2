"""`dflash-trt train`: prompts -> target responses -> cached features -> a trained drafter."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dflash_trt import dir_swap
from dflash_trt.signals import signal_handlers

if TYPE_CHECKING:
    from dflash_trt.models.config import DecoderConfig
    from dflash_trt.train.trainer import TrainConfig

logger = logging.getLogger(__name__)

# The TrainConfig fields that shape the drafter or the tokens it reads and drafts, by flag: a checkpoint continues
# only under its own values (another block size would be accepted, and train a different drafter than it saved).
DRAFTER_FLAGS = {"num_layers": "--layers", "block_size": "--block-size", "target_layer_ids": "--target-layers",
                 "mask_token_id": "--mask-token-id", "draft_vocab_size": "--draft-vocab-size"}


def choose_mask_token(tokenizer, records: list[dict], vocab_size: int) -> int:
    """The largest special token id the data never holds; else an embedding row past the tokenizer's (no text
    maps to it); else the largest id the data never holds, an ordinary token, said in a warning."""
    used = {t for r in records for t in r["prompt_ids"] + r["response_ids"]}
    special = sorted(set(getattr(tokenizer, "all_special_ids", [])) | set(tokenizer.get_added_vocab().values()))
    for tid in reversed(special):
        if tid not in used and tid < vocab_size:
            return tid
    if len(tokenizer) < vocab_size:
        return vocab_size - 1
    tid = next((t for t in range(vocab_size - 1, -1, -1) if t not in used), vocab_size - 1)
    logger.warning("every special token of the tokenizer occurs in the data: the drafter's mask token is %d (%r), an "
                   "ordinary token (a text holding it drafts worse); --mask-token-id ID names another", tid,
                   tokenizer.convert_ids_to_tokens(tid))
    return tid


def check_against_target(cfg: TrainConfig, target_cfg: DecoderConfig, spaced_by_num_features: bool = False) -> None:
    """Fail unless the run's layer ids and mask token exist in the target (else an IndexError hours later).
    spaced_by_num_features: the ids are --num-features' spacing, not --target-layers (the flag an error names)."""
    from dflash_trt.train.trainer import DEFAULT_NUM_FEATURES, evenly_spaced_layers

    n = target_cfg.num_hidden_layers
    flag = "'--num-features'" if spaced_by_num_features else "'--target-layers'"
    # z-lab's spacing (2nd to third-to-last layer) repeats layers below 8 target layers, and leaves 0..n-1 below 4
    spaced = ",".join(map(str, evenly_spaced_layers(n, min(len(cfg.target_layer_ids), n))))
    hint = (f"given, or spaced by --num-features {cfg.num_features or DEFAULT_NUM_FEATURES} over a {n}-layer "
            f"target): pass distinct ids of its layers, e.g. --target-layers {spaced}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < n]
    if bad:
        raise click.BadParameter(f"{bad} not among the target's {n} layers 0..{n - 1} ({hint}", param_hint=flag)
    if len(set(cfg.target_layer_ids)) != len(cfg.target_layer_ids):
        raise click.BadParameter(f"{cfg.target_layer_ids} repeats a layer ({hint}", param_hint=flag)
    vocab = target_cfg.vocab_size
    if cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < vocab:
        raise click.BadParameter(f"{cfg.mask_token_id} is not a token of the target (vocabulary 0..{vocab - 1})",
                                 param_hint="'--mask-token-id'")


# What the data stages write in DATA, and a run in OUT (the data stages' files too: --data may be OUT itself); the
# .tmp/.old names are an interrupted write's leftovers.
DATA_FILES = {"responses.jsonl", "self_prompts.jsonl", "self_prompts.tmp", "features", "target.json", "target.tmp",
              "self_prompts.meta.json", "self_prompts.partial.jsonl", "self_prompts.partial.tmp"}
RUN_FILES = {"checkpoint.pt", "checkpoint.pt.tmp", "train_log.jsonl", "train_log.jsonl.tmp", "drafter",
             "drafter.tmp", "drafter.old", "data", *DATA_FILES}


# What an export writes in OUT/drafter (trainer.py Trainer.export).
EXPORT_FILES = {"config.json", "model.safetensors", "draft_vocab.json", "training.json"}


def check_out_dir(out_dir: Path, data_dir: Path) -> None:
    """Refuse an OUT that holds anything a run did not write: a run replaces OUT/drafter whole and rewrites its log,
    and would mix its files with the others (a model directory, a drafter downloaded to OUT/drafter)."""
    if not out_dir.is_dir():
        return
    ours = set(RUN_FILES)
    if data_dir.resolve().is_relative_to(out_dir.resolve()) and data_dir.resolve() != out_dir.resolve():
        ours.add(data_dir.resolve().relative_to(out_dir.resolve()).parts[0])  # --data OUT/NAME
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in ours and not p.name.startswith("."))
    drafter = out_dir / "drafter"
    if drafter.is_dir() and any(drafter.iterdir()):
        # training.json alone does not say a run in OUT wrote it: a drafter this command trained elsewhere and
        # shipped with a model card (this project's own) has one too, and the first export would replace it whole
        extra = sorted(p.name for p in drafter.iterdir() if p.name not in EXPORT_FILES or not p.is_file())
        if not (drafter / "training.json").is_file():
            foreign.append("drafter/ (no training.json: not a drafter this command trained)")
        elif extra:
            foreign.append(f"drafter/ (holds {', '.join(extra[:3])}: more than a run exports)")
        elif not any((out_dir / name).is_file() for name in ("checkpoint.pt", "train_log.jsonl")):
            foreign.append("drafter/ (no checkpoint.pt or train_log.jsonl beside it: not this run's export)")
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise click.BadParameter(f"{out_dir} holds what no training run wrote ({shown}): choose a new or empty "
                                 "directory", param_hint="'--out'")


def _is_run_out(path: Path) -> bool:
    """Whether `path` is a training run's OUT (its checkpoint, log or exported drafter)."""
    return path.is_dir() and any((path / name).is_file() for name in ("checkpoint.pt", "train_log.jsonl",
                                                                       "drafter/training.json"))


def check_data_dir(data_dir: Path, out_dir: Path) -> None:
    """Refuse a DATA (other than OUT) that holds anything training did not write: the data stages add their
    responses, features and target record to it, and would mix them into a model directory or replace a file of the
    user's. An earlier run's OUT (--data OUT) is training's, and so are the runs' OUTs inside it (--out DATA/NAME)."""
    if not data_dir.is_dir() or data_dir.resolve() == out_dir.resolve():  # OUT's own: check_out_dir's
        return
    ours = set(RUN_FILES)
    if out_dir.resolve().is_relative_to(data_dir.resolve()):  # --out DATA/NAME, before its run made it one
        ours.add(out_dir.resolve().relative_to(data_dir.resolve()).parts[0])
    foreign = sorted(p.name for p in data_dir.iterdir()
                     if p.name not in ours and not p.name.startswith(".") and not _is_run_out(p))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise click.BadParameter(f"{data_dir} holds what no training run wrote ({shown}): choose a new or empty "
                                 "directory, or one an earlier run's --data wrote", param_hint="'--data'")


TARGET_RECORD = "target.json"


def target_fingerprint(target_dir: Path) -> dict:
    """What identifies a target's weights without reading them whole: its config.json, and per weight file its name,
    size and the hashes of its first and last MiB (the headers, and tensors a fine-tune would change)."""
    import hashlib

    files = {}
    for path in sorted(p for p in target_dir.iterdir()
                       if p.suffix in (".safetensors", ".gguf", ".bin") and not p.name.startswith(".")):
        digest, size = hashlib.sha256(), path.stat().st_size
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read())
        files[path.name] = {"size": size, "sha256_ends": digest.hexdigest()}
    config = hashlib.sha256((target_dir / "config.json").read_bytes()).hexdigest()
    return {"config_sha256": config, "weights": files}


# What the target writes in DATA: the record of which target it was is moot while none of them holds anything
_DATA_MADE = ("responses.jsonl", "self_prompts.jsonl", "self_prompts.partial.jsonl", "features")


def _holds_data(data_dir: Path) -> bool:
    return any((data_dir / name).is_file() and (data_dir / name).stat().st_size
               or (data_dir / name).is_dir() and any((data_dir / name).iterdir()) for name in _DATA_MADE)


def check_data_target(data_dir: Path, target_dir: Path) -> None:
    """Fail unless DATA's responses and features were made by this target (its weights, not only its shape); DATA
    made before this record existed is taken as it is, and gets the record, as does DATA holding nothing yet (a run
    that stopped before its first response: a target that failed to load, Ctrl-C)."""
    record = data_dir / TARGET_RECORD
    mine = target_fingerprint(target_dir)
    if record.is_file():
        try:
            theirs = json.loads(record.read_bytes())
            if not isinstance(theirs, dict) or "fingerprint" not in theirs:
                raise ValueError("not a JSON object with a fingerprint")
        except ValueError as e:  # not JSON, not UTF-8, or not the record: a file of the user's, never replaced
            raise click.BadParameter(f"{record} is not the record of the target DATA was made with ({e}): restore "
                                     "it, or pass another --data", param_hint="'--data'") from None
        if _holds_data(data_dir):
            if theirs["fingerprint"] != mine:
                raise click.BadParameter(f"{data_dir} holds the responses and features of another target "
                                         f"({theirs.get('target', 'unknown')}, by {record}): pass another --data, or "
                                         "the --target they were made with", param_hint="'--data'")
            return
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps({"target": str(target_dir.resolve()), "fingerprint": mine}, indent=2) + "\n")
    os.replace(tmp, record)


def check_target_dir(target_dir: Path) -> None:
    """Fail unless target_dir has the tokenizer files: transformers would otherwise make up an empty tokenizer, and
    the run fail at the first prompt with 'empty prompt'."""
    from dflash_trt.models.tokenizer import require_tokenizer_files

    try:
        require_tokenizer_files(target_dir)
    except FileNotFoundError as e:
        raise click.BadParameter(f"{e}: pass the model's whole HF directory", param_hint="'--target'") from e


def check_start(cfg: TrainConfig, target_cfg: DecoderConfig) -> None:
    """Fail unless --init-from-target / --init-drafter can start the run's drafter (else found after the data
    stages, which can take hours)."""
    from dataclasses import replace

    from dflash_trt.models.config import read_config_json
    from dflash_trt.models.dflash import DFlashConfig
    from dflash_trt.train.trainer import check_warm_start, drafter_config_for

    n = target_cfg.num_hidden_layers
    if cfg.init_from_target and cfg.num_layers > n:
        raise click.BadParameter(f"--init-from-target copies the target's last --layers layers; it has {n}, "
                                 f"not {cfg.num_layers}", param_hint="'--layers'")
    if cfg.init_drafter:
        from dflash_trt.models.dflash import load_drafter

        source = str(Path(cfg.init_drafter) / "config.json")
        warm = DFlashConfig.from_dict(read_config_json(Path(cfg.init_drafter)), source)
        warm.check_pairing(target_cfg, source)
        # The mask token does not shape the drafter: any one stands in until the data choose it.
        check_warm_start(warm, drafter_config_for(target_cfg, replace(cfg, mask_token_id=0)), cfg.init_drafter)
        try:  # its weights too (a drafter is small next to the target): missing, cut short or misnamed
            load_drafter(cfg.init_drafter, target_cfg)
        except (ValueError, OSError, RuntimeError) as e:
            raise click.BadParameter(str(e), param_hint="'--init-drafter'") from e


def check_records(records: list[dict], path: Path, vocab_size: int) -> None:
    """Fail on records holding a token the target does not have: DATA holds another target's responses."""
    for r in records:
        for key in ("prompt_ids", "response_ids"):
            if not r[key] or 0 <= min(r[key]) <= max(r[key]) < vocab_size:  # builtins: millions of ids to check
                continue
            bad = next(t for t in r[key] if not 0 <= t < vocab_size)
            raise ValueError(f"{path}: record {r['id']} holds token id {bad} in {key}, outside the target's "
                             f"vocabulary (0..{vocab_size - 1}): its responses are another target's; pass "
                             "another --data")


# Training settings a resumed run may change, with a warning: the checkpoint's run goes on as another one
RESUMED_SETTINGS = {"lr": "--lr", "seqs_per_step": "--seqs-per-step", "anchors_per_seq": "--anchors",
                    "max_seq_len": "--max-seq-len", "gamma": "--gamma", "distill": "--distill",
                    "steer_anchors": "--steer-anchors", "seed": "--seed", "data_dir": "--data"}


def checkpoint_data_dir(out_dir: Path) -> Path | None:
    """The --data of OUT's checkpointed run, where it recorded one (a resumed run reads it there by default)."""
    from dflash_trt.train.trainer import saved_run

    try:
        saved = saved_run(out_dir)
    except ValueError:  # a damaged checkpoint: named where the run checks it (match_checkpoint)
        return None
    data_dir = saved and saved["config"].get("data_dir")
    if not data_dir:
        return None
    if not Path(data_dir).is_dir():  # OUT moved, or its data: OUT/data, the default, rather than all of it again
        click.echo(f"warning: --resume: the checkpoint's run read its data in {data_dir}, which is gone: reading "
                   "OUT/data (pass --data where it is now)", err=True)
        return None
    logger.info("--resume: the checkpoint's run read its data in %s: reading it there", data_dir)
    return Path(data_dir)


def _resume_notes(saved: dict, old: dict, cfg: TrainConfig) -> list[str]:
    """What a resumed run changes of the checkpoint's: its settings, and its learning rate where --steps moved."""
    from dataclasses import replace

    from dflash_trt.train.trainer import lr_at, warmup_share

    notes = [f"{flag} {old[key]} in the checkpoint, {getattr(cfg, key)} now" for key, flag in RESUMED_SETTINGS.items()
             if old.get(key) is not None and old[key] != getattr(cfg, key)]
    if old.get("draft_vocab_loss") is not None and old["draft_vocab_loss"] != cfg.draft_vocab_loss:
        notes.append(f"--full-vocab-loss {'not ' if cfg.draft_vocab_loss else ''}given now, the checkpoint's run "
                     f"trained {'without' if old['draft_vocab_loss'] else 'with'} it: the loss is taken over another "
                     "vocabulary from here on")
    step = saved["step"]
    if cfg.time_budget_s is None and old["time_budget_s"] is None and old["steps"] != cfg.steps:
        then, now = (lr_at(step / n, (step + 1) / n, warmup_share(c, n), c)
                     for n, c in ((old["steps"], replace(cfg, lr=old["lr"], warmup_ratio=old["warmup_ratio"],
                                                         min_lr_ratio=old["min_lr_ratio"])), (cfg.steps, cfg)))
        moves = "stretches" if cfg.steps > old["steps"] else "shrinks"
        notes.append(f"--steps {old['steps']} in the checkpoint, {cfg.steps} now: the learning-rate schedule {moves} "
                     f"to the new length, and step {step + 1} trains at {now:.3g} where it would have at {then:.3g}")
    return notes


def match_checkpoint(out_dir: Path, cfg: TrainConfig, resume: bool, target_cfg: DecoderConfig) -> None:
    """Refuse to overwrite OUT's checkpointed run, or to continue it as another drafter or for another target's shape;
    a resumed run keeps the checkpoint's mask token unless one is given (the one chosen from the data could change as
    records are added)."""
    from dflash_trt.train.trainer import TrainConfig, drafter_config_for, saved_run, shape_mismatches

    saved = saved_run(out_dir)
    if saved is None:
        if resume:
            logger.warning("--resume: %s holds no checkpoint.pt; training starts from step 0", out_dir)
        return
    if not resume:
        raise click.UsageError(f"{out_dir} already holds a training run (checkpoint.pt, step {saved['step']}): "
                               "pass --resume to continue it, or choose another --out")
    # Over the defaults: older checkpoints predate some fields.
    old = {**asdict(TrainConfig()), **saved["config"]}
    if cfg.mask_token_id is None:
        cfg.mask_token_id = old["mask_token_id"]
        check_against_target(cfg, target_cfg)
    differ = [f"{flag} {old[key]} in the checkpoint, {getattr(cfg, key)} now" for key, flag in DRAFTER_FLAGS.items()
              if old[key] != getattr(cfg, key)]
    if differ:
        raise click.UsageError(f"--resume: {out_dir / 'checkpoint.pt'} holds another drafter ({'; '.join(differ)}): "
                               "pass the checkpoint's values, or choose another --out")
    if cfg.mask_token_id is not None:  # None: a checkpoint older than the mask token's record; shapes unchecked
        shapes = shape_mismatches(saved["shapes"], drafter_config_for(target_cfg, cfg))
        if shapes:
            raise click.UsageError(f"--resume: {out_dir / 'checkpoint.pt'} holds a drafter for a target of another "
                                   f"shape ({'; '.join(shapes[:3])}{'; ...' if len(shapes) > 3 else ''}): pass the "
                                   "--target it was trained for, or choose another --out")
    for note in _resume_notes(saved, old, cfg):
        click.echo(f"warning: --resume: {note}", err=True)
    if saved["step"] >= cfg.steps:
        raise click.UsageError(f"--resume: {out_dir / 'checkpoint.pt'} is at step {saved['step']} already, and "
                               f"--steps {cfg.steps} counts the checkpoint's: pass a larger --steps to train on")
    if cfg.time_budget_s is not None and old["time_budget_s"] is not None and saved["step"] >= old["steps"]:
        # its schedule, fitted to its budget, has ended (the learning rate at its floor): a larger budget would train
        # nothing (the length is re-fitted only after a step), and re-fitting it would warm the rate up again
        raise click.UsageError(f"--resume: {out_dir / 'checkpoint.pt'} ended its run at step {saved['step']} (its "
                               f"learning-rate schedule, fitted to its time budget, is done): to train that drafter "
                               f"further, start a new run from it (--init-drafter {out_dir / 'drafter'} --out NEW_DIR)")


RUN_LOCK = ".dflash-train.lock"


@contextlib.contextmanager
def one_run_at_a_time(path: Path, flag: str) -> Iterator[None]:
    """An flock on PATH/.dflash-train.lock for the block: a second run on the same --out or --data (both would append
    to its logs and responses) is refused while this one holds it. Free again when the process ends, killed too."""
    fd = os.open(path / RUN_LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise click.BadParameter(f"{path} is in use by another training run (it holds {path / RUN_LOCK}): wait for "
                                 "it to end, or pass another directory", param_hint=f"'{flag}'") from None
    except OSError as e:
        if e.errno not in dir_swap.LOCKLESS:
            os.close(fd)
            raise
        logger.warning("%s: no lock on this file system (%s): another run could use it at once", path / RUN_LOCK,
                       e.strerror)
    if not dir_swap.still_there(fd, path / RUN_LOCK):  # a failed run beside this one removed it as it was taken
        os.close(fd)
        raise click.BadParameter(f"{path} was removed by another training run that stopped as this one started: run "
                                 "again", param_hint=f"'{flag}'")
    try:
        yield
    finally:
        os.close(fd)


def _unmade_on_failure(made: list[Path]):
    """An ExitStack exit callback: on an exception, removes the directories this run made (MADE, filled as it makes
    them; deepest first) that hold nothing but a free run lock and the target record. Pushed before the locks are
    taken, so that it runs after they are released; a lock another run holds (one that started on the directory
    meanwhile) keeps it."""

    def exit_(exc_type, exc, tb) -> bool:
        if exc_type is not None:
            for path in sorted(made, key=lambda p: len(Path(os.path.abspath(p)).parts), reverse=True):
                try:
                    if not {entry.name for entry in path.iterdir()} <= {RUN_LOCK, TARGET_RECORD}:
                        continue
                    dir_swap.unlink_if_free(path / RUN_LOCK)
                    if (path / RUN_LOCK).exists():  # another run holds it
                        continue
                    (path / TARGET_RECORD).unlink(missing_ok=True)
                    path.rmdir()
                except OSError:  # written meanwhile: left as it is
                    pass
        return False

    return exit_


@contextlib.contextmanager
def _termination_as_interrupt():
    """SIGTERM or SIGHUP in the data stages ends the run as Ctrl-C does (what was kept is said, exit 130); the
    training stage sets its own handler over this one, which finishes and saves the step first."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    with signal_handlers(interrupt, signal.SIGTERM, signal.SIGHUP):
        yield


def shortest_prompt(tokenizer, prompts, lens: list[int], chat: bool, candidates: int = 8) -> int | None:
    """Tokens of the shortest prompt as the target is asked it (through its chat template where it has one), or None
    without prompts; `lens`: their tokens as written. The template adds about the same to every prompt: only the few
    shortest as written are rendered (thousands would take a while)."""
    from dflash_trt.engine.prompt_encoder import PromptEncoder

    if not prompts:
        return None
    if not chat:
        return min(lens)
    encoder = PromptEncoder(tokenizer, max_model_len=10**9)
    shortest = sorted(range(len(prompts)), key=lens.__getitem__)[:candidates]
    return min(len(encoder.encode(prompts[i].text, chat=True)) for i in shortest)


def prepare_and_train(target_dir: Path, out_dir: Path, data_dir: Path, cfg, prompts, resume: bool,
                      max_new_tokens: int = 256, sampled_variants: int = 1, dtype: str = "bfloat16",
                      device: str = "cpu", self_prompts: int = 0, features: str | None = None) -> Path:
    """The whole pipeline; each stage resumes where an interrupted run stopped.

    features: "cache" (the target's features cached on disk once: on the CPU a target forward per step costs more
    than the drafter's) or "live" (computed per batch: on a GPU cheaper than reading them back, and on the CPU where the
    cache would not fit the disk); None: cache on the CPU, live on a GPU.
    """
    features = features or ("cache" if device == "cpu" else "live")
    from dflash_trt.bench.datasets import load_dataset
    from dflash_trt.engine.llm_engine import DTYPES, EngineConfig, LLMEngine
    from dflash_trt.models.config import decoder_config_from_dict, read_config_json
    from dflash_trt.models.registry import load_target
    from dflash_trt.models.tokenizer import load_tokenizer
    from dflash_trt.train.feature_cache import TargetFeatures, build_feature_cache, check_index, space_shortfall
    from dflash_trt.train.responses import generate_responses
    from dflash_trt.train.self_prompts import (
        SUMMARY_SOURCE,
        answer_with_summaries,
        cached_self_prompts,
        write_prompts,
    )
    from dflash_trt.train.trainer import Trainer, feature_layer_ids

    # Everything checkable is checked before the data stages, which can take hours.
    target_cfg = decoder_config_from_dict(read_config_json(target_dir), str(target_dir / "config.json"))
    check_target_dir(target_dir)
    spaced = not cfg.target_layer_ids
    cfg.target_layer_ids = list(cfg.target_layer_ids or feature_layer_ids(target_cfg.num_hidden_layers,
                                                                            cfg.num_features))
    check_against_target(cfg, target_cfg, spaced_by_num_features=spaced)
    check_start(cfg, target_cfg)
    check_out_dir(out_dir, data_dir)
    check_data_dir(data_dir, out_dir)
    match_checkpoint(out_dir, cfg, resume, target_cfg)
    try:
        tokenizer = load_tokenizer(target_dir, target_cfg.vocab_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--target'") from None
    # a base model (no chat template) answers its prompts as plain text, as it is served (/v1/completions)
    chat = bool(getattr(tokenizer, "chat_template", None))
    if not chat and self_prompts:
        raise click.BadParameter(f"{target_dir} has no chat template, and the target writes its own requests from "
                                 "its template's user turn", param_hint="'--self-prompts'")
    if not chat:
        logger.warning("%s has no chat template: its prompts are answered as plain text", target_dir)
    prompt_lens = [len(ids) for ids in tokenizer([p.text for p in prompts])["input_ids"]] if prompts else []
    shortest = shortest_prompt(tokenizer, prompts, prompt_lens, chat)
    if shortest is not None and shortest >= cfg.max_seq_len:  # else found after the data stages, hours on a real run
        raise click.BadParameter(f"{cfg.max_seq_len} leaves no room for a response token after any prompt (the "
                                 f"shortest has {shortest} tokens{' in the chat template' if chat else ''}): training "
                                 "reads the first max_seq_len tokens of prompt + response",
                                 param_hint="'--max-seq-len'")
    with contextlib.ExitStack() as held:  # the run's locks on --out and --data, until it ends
        # a run refused (or failing) before it wrote anything leaves no directory it made, as if never started
        made_here: list[Path] = []
        held.push(_unmade_on_failure(made_here))
        # --out is made only once another --data is found to be this target's (a refused one left an empty --out)
        made = [(data_dir, "--data"), (out_dir, "--out")]
        for path, flag in made[::-1] if data_dir.resolve().is_relative_to(out_dir.resolve()) else made:
            try:
                try:
                    path.mkdir(parents=True)
                    made_here.append(path)
                except FileExistsError:  # there already, or made meanwhile by another run
                    pass
                # writable now, not after the responses and features (hours on a real run): an existing read-only one
                tempfile.TemporaryFile(dir=path).close()
            except OSError as e:
                raise click.BadParameter(f"cannot write in {path}: {e.strerror or e}", param_hint=f"'{flag}'") from e
            if flag == "--data" or path.resolve() != data_dir.resolve():  # --data OUT: one lock for both
                held.enter_context(one_run_at_a_time(path, flag))
            if flag == "--data":
                check_data_target(data_dir, target_dir)
        if features == "cache":
            feature_dim = target_cfg.hidden_size * len(cfg.target_layer_ids)
            check_index(data_dir / "features", feature_dim, cfg.target_layer_ids)
            # a bound on the tokens cached: each response at its longest (+ a chat template's tokens), cut to
            # max_seq_len; the target's own requests (five personas and the summaries) at max_seq_len
            longest = [min(cfg.max_seq_len, n + 32 + max_new_tokens) for n in prompt_lens]
            bound = (sum(longest) + 6 * self_prompts * cfg.max_seq_len) * (1 + sampled_variants)
            if shortfall := space_shortfall(data_dir / "features", bound, feature_dim):
                click.echo(f"warning: {shortfall}", err=True)
        target = load_target(target_dir, DTYPES[dtype], device)
        rows = 16 if device == "cpu" else 128
        # Responses are generated whole and cut to max_seq_len only for training: a short max_seq_len must not refuse
        # the packaged prompts.
        context = max(cfg.max_seq_len, 1024) + max_new_tokens
        engine = LLMEngine(target, tokenizer, None, EngineConfig(max_batch_size=rows, speculative=False, dtype=dtype,
                                                                 max_model_len=context, device=device))
        responses, prompts_path = data_dir / "responses.jsonl", data_dir / "self_prompts.jsonl"
        own = []
        if self_prompts:
            # After the packaged prompts, so that their records keep their ids; the benchmark's prompts stay unseen.
            bench = {p.text for p in load_dataset("cpu-small")}
            own = cached_self_prompts(engine, prompts_path, self_prompts, bench)
            prompts = list(prompts) + own
        answer = dict(max_new_tokens=max_new_tokens, sampled_variants=sampled_variants, batch_size=rows, chat=chat)
        if own and not any(p.source == SUMMARY_SOURCE for p in own):
            # Summaries quote the qa answers just generated; stored before they are answered (ids are positions).
            _, records = answer_with_summaries(engine, tokenizer, prompts, responses, bench,
                                               store=lambda summaries: write_prompts(prompts_path, own + summaries),
                                               **answer)
        else:
            records = generate_responses(engine, prompts, responses, **answer)
        check_records(records, responses, target.config.vocab_size)
        if cfg.mask_token_id is None:
            cfg.mask_token_id = choose_mask_token(tokenizer, records, target.config.vocab_size)
        if features == "cache":
            sequences = [(r["id"], (r["prompt_ids"] + r["response_ids"])[: cfg.max_seq_len]) for r in records]
            source = build_feature_cache(target, sequences, data_dir / "features", cfg.target_layer_ids,
                                         compute_with=lambda: feature_target(target, target_dir))
        else:
            source = TargetFeatures(target, cfg.target_layer_ids)
        trainer = Trainer(target, target_dir, tokenizer, records, source, out_dir, cfg, resume=resume)
        trainer.train()
        return out_dir / "drafter"


def feature_target(target, target_dir: Path):
    """The target the CPU feature cache is computed with: a bf16 target's fp32 twin where the CPU emulates bf16
    (hardware.native_bf16), else the target itself. Whole-sequence prefills run on torch's matmuls, which an AVX2 CPU
    runs ~5x faster in fp32 (SmolLM2: 489 against 91 tok/s on an AMD EPYC, benchmarks/bench_train_precision.py); the
    features are stored in fp16 either way."""
    import torch

    from dflash_trt.hardware import native_bf16
    from dflash_trt.models.registry import load_target

    weight = target.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or native_bf16("cpu"):
        return target
    return load_target(target_dir, torch.float32, "cpu")


def interrupted_state(out_dir: Path, data_dir: Path) -> str:
    """What an interrupted run leaves for --resume, in a sentence or two."""
    from dflash_trt.train.responses import read_records
    from dflash_trt.train.trainer import saved_run

    try:
        saved = saved_run(out_dir)
        done = len(read_records(data_dir / "responses.jsonl"))
    except ValueError:
        return "Kept: what was done before, in --out and --data."
    index = data_dir / "features" / "index.json"
    try:
        featured = sum(len(s["sequences"]) for s in json.loads(index.read_text())["shards"]) if index.is_file() else 0
    except (ValueError, KeyError, TypeError):
        featured = 0
    cached = f", the features of {featured} sequences in {index.parent}" if featured else ""
    data = f"Kept: {done} responses in {data_dir / 'responses.jsonl'}{cached}"
    partial = data_dir / "self_prompts.partial.jsonl"
    if not done and partial.is_file():  # interrupted while the target wrote its own prompts
        from dflash_trt.train.self_prompts import read_prompts

        try:
            data = f"Kept: {len(read_prompts(partial))} self-written prompts of finished personas in {partial}"
        except ValueError:
            pass
    if saved is None:
        return data + "; no training checkpoint yet."
    return data + f"; training at step {saved['step']} in {out_dir / 'checkpoint.pt'}."


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange, NaN and infinity refused (they pass its bounds: NaN compares false, and an --lr of inf
    trained a NaN drafter, exported as the best)."""

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if not math.isfinite(value):
            self.fail(f"{value} is not a finite number", param, ctx)
        return value


def _layer_ids(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated layer indices such as 1,8,14, got {value!r}") from None


def _device(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """cpu, or a CUDA device this torch can reach (else loading the target fails with an AssertionError)."""
    import torch

    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise click.BadParameter(f"expected cpu, cuda or cuda:N, got {value!r}")
    if value != "cpu" and not torch.cuda.is_available():
        raise click.BadParameter(f"{value}: no CUDA device is available to this torch {torch.__version__}")
    if value.startswith("cuda:") and int(value[5:]) >= torch.cuda.device_count():
        raise click.BadParameter(f"{value}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return value


@click.command("train")
@click.option("--target", type=click.Path(exists=True, file_okay=False), help="HF-format target (default: the embedded SmolLM2-135M-Instruct).")
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False),
              help="Output directory (checkpoint.pt, train_log.jsonl, drafter/).")
@click.option("--data", type=click.Path(file_okay=False), help="Data directory (responses + feature cache; default OUT/data).")
@click.option("--layers", default=2, show_default=True, type=click.IntRange(min=1), help="Drafter decoder layers.")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=2),
              help="Draft block size B (K up to B-1).")
@click.option("--target-layers", default=None, callback=_layer_ids,
              help="Comma-separated target layer ids to fuse (default: z-lab spacing).")
@click.option("--num-features", type=click.IntRange(min=1),
              help="Target layers to fuse when --target-layers is not given, spaced as z-lab's.  [default: 5, or on "
                   "a target under 8 layers up to 5 spread over all its layers]")
@click.option("--steps", default=2000, show_default=True, type=click.IntRange(min=1),
              help="Optimizer steps in all (with --resume, counting the checkpoint's).")
@click.option("--lr", default=6e-4, show_default=True, type=FiniteFloatRange(min=0, min_open=True),
              help="Peak AdamW learning rate (linear warmup over the first 4% of steps, then cosine decay to 5% of it).")
@click.option("--seqs-per-step", default=4, show_default=True, type=click.IntRange(min=1),
              help="Training records drawn per optimizer step.")
@click.option("--micro-batch", default=None, type=click.IntRange(min=1), help="Sequences per drafter forward (default: all of --seqs-per-step).")
@click.option("--time-budget", default=None, type=FiniteFloatRange(min=0, min_open=True),
              help="Seconds: end the run (at most --steps), its LR schedule and its evaluations, the closing one "
                   "included, within this wall-clock time, a resumed run's earlier training included. A run trains "
                   "at least one step: a budget too short for that and its evaluation is overrun, with a warning.")
@click.option("--device", default="cpu", show_default=True, callback=_device, help="cpu or cuda[:N].")
@click.option("--features", type=click.Choice(["cache", "live"]), default=None,
              help="The target's features: cached on disk once (default on the CPU; float16, 2 bytes x hidden x "
              "target layers a token: 52 GB for the shipped data) or computed per training batch (default on a GPU).")
@click.option("--anchors", default=32, show_default=True, type=click.IntRange(min=1), help="Random anchors per sequence.")
@click.option("--eval-every", default=250, show_default=True, type=click.IntRange(min=1),
              help="Steps between evaluations on the held-out records (also after the last step); each one saves "
                   "checkpoint.pt, and OUT/drafter when it scores best (always, with nothing held out).")
@click.option("--max-seq-len", default=1024, show_default=True, type=click.IntRange(min=16), help="Tokens of each record trained on (prompt first).")
@click.option("--gamma", default=None, type=FiniteFloatRange(min=0, min_open=True),
              help="The loss's position decay exp(-(k-1)/gamma) (default: by block size, 4 for 8).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(-2**63, 2**64 - 1),  # torch's seeds
              help="Seed of the drafter's initialization and of the records and anchors drawn for each step.")
@click.option("--sampled-variants", default=1, show_default=True, type=click.IntRange(min=0),
              help="Sampled responses per prompt besides the greedy one (0: greedy only).")
@click.option("--response-tokens", default=256, show_default=True, type=click.IntRange(min=1),
              help="Most tokens the target generates per response (responses already in DATA are kept as they are).")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
              help='Your own prompts instead of the packaged ones: JSONL, {"text": "...", "source": "..."} a line '
                   "(source optional: a category label). The target answers each; about 5% are held out, by a hash "
                   "of the text. Add prompts later at the end of the file (a record's id is its prompt's position).")
@click.option("--max-prompts", default=None, type=click.IntRange(min=1), help="Use only the first N prompts (quick runs).")
@click.option("--self-prompts", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also N requests per persona (chat, code, math, qa, writing) written by the target itself (Magpie), "
                   "and summarization requests quoting its answers to the qa ones; all answered like the rest.")
@click.option("--mask-token-id", default=None, type=int, help="Default: an unused special token of the target.")
@click.option("--init-from-target", is_flag=True, help="Start the drafter layers from the target's last layers.")
@click.option("--init-drafter", type=click.Path(exists=True, file_okay=False), help="Warm start from a trained drafter (z-lab format, same width; with fewer layers than --layers, the extra ones start as identities).")
@click.option("--distill", default=0.0, show_default=True, type=FiniteFloatRange(0.0, 1.0),
              help="Weight of the KL to the target's own next-token distribution against the hard labels' CE (0: hard labels only).")
@click.option("--draft-vocab-size", default=None, type=click.IntRange(min=1),
              help="Draft among (and train the loss over) only the N most frequent response tokens (default: all).")
@click.option("--steer-anchors", default=0.0, show_default=True, type=FiniteFloatRange(0.0, 1.0),
              help="Share of the random anchors moved to where the drafter's next decoding step from them would start.")
@click.option("--full-vocab-loss", is_flag=True, help="Softmax over the whole vocabulary (default: over the draft vocabulary the drafter ships and drafts among).")
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint.pt (data stages always resume).")
def train(target, out, data, layers, block_size, target_layers, num_features, steps, lr, seqs_per_step, micro_batch,
          time_budget, device, anchors, eval_every, max_seq_len, gamma, seed, sampled_variants, response_tokens,
          prompts_file, max_prompts, self_prompts, mask_token_id, init_from_target, init_drafter, distill,
          draft_vocab_size, steer_anchors, full_vocab_loss, resume, features) -> None:
    """Train a DFlash drafter for a target, written in z-lab's format to OUT/drafter."""
    from dflash_trt.train.prompts import all_prompts, read_user_prompts
    from dflash_trt.train.trainer import TrainConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if target is None:
        from dflash_trt.embedded import smollm2_dir

        target = smollm2_dir()
    if init_from_target and init_drafter:  # the trainer would load one over the other
        raise click.UsageError("--init-from-target and --init-drafter are two warm starts: pass one")
    if block_size > max_seq_len:  # TrainConfig's check, by the flags' names
        raise click.BadParameter(f"{block_size} is longer than --max-seq-len ({max_seq_len}): a block's positions past "
                                 "the sequences would never be labelled", param_hint="'--block-size'")
    out_dir = Path(out)
    data_dir = Path(data) if data else (resume and checkpoint_data_dir(out_dir)) or out_dir / "data"
    try:
        cfg = TrainConfig(num_layers=layers, block_size=block_size, target_layer_ids=target_layers, num_features=num_features,
                          steps=steps, lr=lr, seqs_per_step=seqs_per_step, micro_batch=micro_batch,
                          time_budget_s=time_budget, anchors_per_seq=anchors, max_seq_len=max_seq_len, gamma=gamma,
                          seed=seed, eval_every=eval_every, mask_token_id=mask_token_id, init_from_target=init_from_target,
                          init_drafter=init_drafter, draft_vocab_loss=not full_vocab_loss,
                          draft_vocab_size=draft_vocab_size, distill=distill,
                          steer_anchors=steer_anchors, data_dir=str(data_dir.resolve()))
        prompts = read_user_prompts(Path(prompts_file)) if prompts_file else all_prompts()
        if max_prompts:
            prompts = prompts[:max_prompts]
        with _termination_as_interrupt():
            drafter = prepare_and_train(Path(target), out_dir, data_dir, cfg, prompts, resume,
                                        max_new_tokens=response_tokens, sampled_variants=sampled_variants,
                                        device=device, self_prompts=self_prompts, features=features)
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from e
    except KeyboardInterrupt:
        # Click alone says only "Aborted!": say what was kept, and how to go on.
        click.echo(f"\nInterrupted. {interrupted_state(out_dir, data_dir)} Run the same command with --resume to "
                   "continue from there.", err=True)
        raise click.exceptions.Exit(130) from None
    # The best on the held-out split, or the last with nothing held out: which step and score it is.
    made = drafter / "training.json"
    made = json.loads(made.read_text()) if made.is_file() else None
    score = made and made["metrics"].get("val_tau")
    click.echo(f"drafter: {drafter}" + (f" (step {made['step']}{f', held-out tau {score:.2f}' if score else ''})"
                                        if made else ""))
    click.echo(f"log: {out_dir / 'train_log.jsonl'}; checkpoint (for --resume): {out_dir / 'checkpoint.pt'}; "
               f"data: {data_dir}")
