"""Train the SmolLM2 drafter on a lent GPU, inside one device call (issue 3).

The CPU runs give ~4 sequence passes a second; one H200 gives hundreds. On the GPU machine (no network, no PyPI)
this script:
1. rebuilds the target from the project's GGUF (carried in zstd parts, `--gguf-parts`) and the tokenizer files
   carried from this machine's converted copy (`--tokenizer`), so token ids agree with the CPU side; `--target-dir`
   keeps it for later runs (`--prepare-only` builds it and stops: benchmarks/gpu_train_leg.sh trains two recipes
   side by side on one target);
2. optionally extends the training data (`--gen-seconds`, 0 skips it): the target answers the prompts not yet
   answered (`--prompts`, exported by `benchmarks/stage_gpu_training.py`) through this project's model code on CUDA,
   `--gen-rows` at a time in one static batch (dflash_trt/train/batch_generation.py);
3. trains (dflash_trt.train.trainer on CUDA, target features computed per batch), warm-started from `--init-drafter`
   (grown to `--layers` where deeper), with the CPU runs' recipe flags (distillation, steered anchors, the draft
   vocabulary), fitted to `--train-seconds` or to what `--deadline-s` leaves;
4. writes the best drafter (held-out tau, or loss with `--eval-prompts 0`; the warm start, scored before training,
   unless a step beats it), the training log and, if it grew, the data set to `--out`.

First run (H200, 2026-11-30): generation through the serving engine on CUDA at 256 rows reached only ~1.8k tok/s and
a training step of 32 sequences took ~80-120 ms (Python-side batch assembly and per-step launches), so later legs
train on the records the CPU runs generated and put the GPU's time into steps.

`--smoke` runs the same path on a tiny random target in seconds (the first call checks the GPU path).

    python3 benchmarks/gpu_train_drafter.py --gguf-parts A,B --tokenizer DIR --records R.jsonl.gz \\
        --init-drafter drafters/smollm2-135m-dflash --out OUT --work /root/run
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402
from dflash_trt.train.batch_generation import BatchGenerator  # noqa: E402
from dflash_trt.train.feature_cache import TargetFeatures  # noqa: E402
from dflash_trt.train.prompts import Prompt  # noqa: E402
from dflash_trt.train.responses import generate_responses, read_records  # noqa: E402
from dflash_trt.train.trainer import TrainConfig, Trainer, held_out_score  # noqa: E402

MAX_SEQ_LEN = {True: 96, False: 640}  # by --smoke
MAX_NEW = {True: 24, False: 256}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def join_gguf(parts: list[str], path: Path) -> Path:
    """Concatenate the zstd halves and decompress (the zstd CLI if there, else pyarrow's codec)."""
    packed = path.with_suffix(".zst")
    with packed.open("wb") as f:
        for part in parts:
            f.write(Path(part).read_bytes())
    if shutil.which("zstd"):
        subprocess.run(["zstd", "-d", "-q", "-f", "--long=27", str(packed), "-o", str(path)], check=True)
    else:
        import pyarrow as pa

        with pa.CompressedInputStream(pa.OSFile(str(packed)), "zstd") as fi, path.open("wb") as fo:
            shutil.copyfileobj(fi, fo)
    packed.unlink()
    return path


def build_target(args, work: Path) -> Path:
    out = Path(args.target_dir) if args.target_dir else work / "target"
    if (out / "config.json").is_file():  # built by an earlier run (--prepare-only)
        return out
    if args.smoke:
        from tests.conftest import make_target

        return make_target(out, layers=4, seed=2)
    from dflash_trt.convert import convert_gguf

    convert_gguf(join_gguf(args.gguf_parts.split(","), work / "smollm2.gguf"), out)
    tok = Path(args.tokenizer)
    for name in TOKENIZER_FILES:  # this machine's transformers may convert the tokenizer differently
        if (tok / f"{name}.gz").is_file():
            with gzip.open(tok / f"{name}.gz", "rb") as fi, open(out / name, "wb") as fo:
                shutil.copyfileobj(fi, fo)
    with gzip.open(tok / "config.json.gz", "rt") as f:
        want = json.load(f)
    got = json.loads((out / "config.json").read_text())
    diff = {k for k in set(want) | set(got) if want.get(k) != got.get(k) and k != "transformers_version"}
    print(f"target config differences from the CPU copy: {sorted(diff) or 'none'}", flush=True)
    return out


def smoke_prompts() -> list[Prompt]:
    words = ["red", "blue", "tea", "a cat", "rain", "wind", "snow", "music", "a ship", "gold", "a map", "salt"]
    return [Prompt(f"question {i}: what is {w}?", "smoke") for i, w in enumerate(words * 4)]


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def extend_data(args, target, tokenizer, data: Path, out: Path, device: str) -> list[dict]:
    """Answer the prompts not yet answered (greedy first, then one sampled variant each) until --gen-seconds."""
    prompts = (smoke_prompts() if args.smoke
               else [Prompt(p["text"], p["source"]) for p in read_jsonl_gz(Path(args.prompts))])
    max_new = MAX_NEW[args.smoke]
    # The engine encodes; BatchGenerator generates (the engine's own scheduling ran at ~1.8k tok/s on an H200).
    engine = LLMEngine(target, tokenizer, None, EngineConfig(max_batch_size=1, speculative=False, dtype="bfloat16",
                                                             device=device,
                                                             max_model_len=MAX_SEQ_LEN[args.smoke] + max_new))
    before = len(read_records(data))
    t0 = time.monotonic()
    # Greedy answers to prompts not yet answered first (new prompts add more than new samples of old ones), then
    # samples.
    for variants in (0, 1):
        records = generate_responses(BatchGenerator(engine), prompts, data, max_new_tokens=max_new,
                                     sampled_variants=variants, batch_size=args.gen_rows,
                                     deadline=t0 + args.gen_seconds)
    gen_s = time.monotonic() - t0
    new = records[before:]
    new_tokens = sum(len(r["response_ids"]) for r in new)
    print(f"generated {len(new)} responses, {new_tokens} tokens in {gen_s:.0f} s ({new_tokens / gen_s:.0f} tok/s)",
          flush=True)
    with gzip.open(out / "responses.jsonl.gz", "wt") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    del engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-parts", help="comma-separated zstd parts of the GGUF (benchmarks/stage_gpu_training.py)")
    ap.add_argument("--tokenizer", help="directory with the CPU side's converted config.json and tokenizer files")
    ap.add_argument("--prompts", help="JSONL.gz of {text, source}: all training prompts in their stable order")
    ap.add_argument("--records", help="JSONL.gz of responses already generated (kept, extended)")
    ap.add_argument("--init-drafter")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/root/run")
    ap.add_argument("--target-dir", help="where the converted target is kept (default WORK/target)")
    ap.add_argument("--prepare-only", action="store_true", help="build the target (and tokenizer), then stop")
    ap.add_argument("--gen-seconds", type=float, default=0)
    ap.add_argument("--gen-only", action="store_true", help="stop once the data is extended (OUT/responses.jsonl.gz)")
    ap.add_argument("--train-seconds", type=float, help="training time (default: what --deadline-s leaves, else 320)")
    ap.add_argument("--deadline-s", type=float,
                    help="end the whole run this many seconds after it started (fits the training to what is left)")
    ap.add_argument("--layers", type=int, default=2, help="drafter depth (a shallower --init-drafter is grown)")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup-ratio", type=float, default=0.03)
    ap.add_argument("--seqs-per-step", type=int, default=128)
    ap.add_argument("--anchors-per-seq", type=int, default=48)
    ap.add_argument("--gamma", type=float, default=2.0)
    ap.add_argument("--distill", type=float, default=0.5)
    ap.add_argument("--draft-vocab-size", type=int, default=2048, help="0: every response token")
    ap.add_argument("--gen-rows", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-prompts", type=int, default=16, help="0: pick the best drafter by held-out loss")
    ap.add_argument("--steer-anchors", type=float, default=0.5,
                    help="share of the anchors moved to where the drafter's next step would start (TrainConfig)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t_start = time.monotonic()
    out, work = Path(args.out), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}, "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}", flush=True)
    device = args.device

    from transformers import AutoTokenizer

    target_dir = build_target(args, work)
    if args.prepare_only:
        print(f"target ready in {target_dir} at {time.monotonic() - t_start:.0f} s", flush=True)
        return
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_target(target_dir, torch.bfloat16, device)
    print(f"target ready at {time.monotonic() - t_start:.0f} s", flush=True)

    # -- data -------------------------------------------------------------------------------------------
    data = work / "responses.jsonl"
    if args.records and not data.exists():
        with data.open("w") as f:
            for r in read_jsonl_gz(Path(args.records)):
                f.write(json.dumps(r) + "\n")
    records = read_records(data)
    if args.gen_seconds > 0:
        records = extend_data(args, target, tokenizer, data, out, device)
    print(f"{len(records)} records", flush=True)
    if args.gen_only:
        return

    # -- train ------------------------------------------------------------------------------------------
    if args.smoke:
        from dflash_trt.train.cli import choose_mask_token

        init, layer_ids, mask_id = None, [1, 2], choose_mask_token(tokenizer, records, target.config.vocab_size)
    else:
        init = args.init_drafter
        dcfg = json.loads((Path(init) / "config.json").read_text())["dflash_config"]
        layer_ids, mask_id = dcfg["target_layer_ids"], dcfg["mask_token_id"]
    budget = args.train_seconds or 320.0
    if args.deadline_s is not None:  # room after training: the last export and the copy out
        left = args.deadline_s - (time.monotonic() - t_start) - 15
        budget = left if args.train_seconds is None else min(args.train_seconds, left)
    cfg = TrainConfig(num_layers=args.layers, block_size=args.block_size, target_layer_ids=layer_ids,
                      mask_token_id=mask_id, steps=1_000_000, lr=args.lr, warmup_ratio=args.warmup_ratio,
                      seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq, gamma=args.gamma,
                      max_seq_len=MAX_SEQ_LEN[args.smoke], eval_every=args.eval_every, eval_prompts=args.eval_prompts,
                      eval_new_tokens=96, time_budget_s=budget, init_drafter=init, steer_anchors=args.steer_anchors,
                      distill=args.distill, draft_vocab_size=args.draft_vocab_size or None, seed=args.seed)
    trainer = Trainer(target, target_dir, tokenizer, records, TargetFeatures(target, layer_ids), work / "out", cfg)
    t0 = time.monotonic()
    start = trainer.evaluate()  # the warm start's score on the same held-out prompts, for comparison
    if "val_loss" in start:  # the bar to beat: a run that only gets worse exports the warm start, not its least bad
        trainer.best_score = held_out_score(start)
        trainer.best_loss = start["val_loss"]
        trainer.export(work / "out" / "drafter", start)
    print(f"before training: {json.dumps(start)}; training budget {budget:.0f} s", flush=True)
    trainer.cfg.time_budget_s = budget - (time.monotonic() - t0)
    trainer.train()
    train_s = time.monotonic() - t0
    log = [json.loads(x) for x in (work / "out" / "train_log.jsonl").read_text().splitlines()]
    evals = [e for e in log if "val_loss" in e]
    shutil.copytree(work / "out" / "drafter", out / "drafter", dirs_exist_ok=True)
    shutil.copy(work / "out" / "train_log.jsonl", out / "train_log.jsonl")
    print(f"\ntrained {trainer.step} steps x {cfg.seqs_per_step} sequences in {train_s:.0f} s "
          f"({train_s / max(trainer.step, 1) * 1e3:.0f} ms/step); first loss {log[0]['loss']:.3f}, "
          f"last 50 mean {sum(e['loss'] for e in log[-50:]) / len(log[-50:]):.3f}")
    for e in evals:
        tau = f"  val_tau {e['val_tau']:.3f}" if "val_tau" in e else ""
        print(f"step {e['step']:6d}  val_loss {e['val_loss']:.3f}{tau}")
    step = json.loads((out / "drafter" / "training.json").read_text())["step"]
    print(f"best held-out score (tau, or -loss) {trainer.best_score:.3f}, exported from step {step}"
          f"{' (the warm start: no evaluation beat it)' if step == 0 else ''}; "
          f"total {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
