"""Train the SmolLM2 drafter on a lent GPU, inside one device call (issue 3).

The CPU run gave ~23k sequence passes in hours; one H200 gives that in seconds. On the GPU machine
(no network, no PyPI) this script:
1. rebuilds the target from the project's GGUF (carried in two zstd halves, `--gguf-parts`) and the tokenizer files carried from
   this machine's converted copy (`--tokenizer`), so token ids agree with the CPU side;
2. extends the training data: the target answers the remaining prompts (`--prompts`, exported by
   `benchmarks/stage_gpu_training.py` from the packaged corpora, split by the same hash) greedily and sampled,
   through this project's runtime on CUDA, for `--gen-seconds`;
3. trains (dflash_trt.train.trainer on CUDA, target features computed per batch), warm-started from the
   shipped drafter, with block size 16, fitted to `--train-seconds`;
4. writes the best drafter (held-out tau; model.safetensors in 9 MiB parts, since a device call returns files
   of at most 16 MiB), the training log and the grown data set to `--out` ($OUT).

First run (H200, 2026-11-30): generation through this runtime on CUDA at 256 rows reached only ~1.8k tok/s and a
training step of 32 sequences took ~80-120 ms: both far from the GPU's limits (Python-side batch assembly and
per-step launches); profile these before the next long run.

`--smoke` runs the same path on a tiny random target in seconds (the first call checks the GPU path).

    python3 benchmarks/gpu_train_drafter.py --gguf-parts A,B --tokenizer DIR --prompts P.jsonl.gz \\
        --records R.jsonl.gz --init-drafter drafters/smollm2-135m-dflash --out $OUT --work /root/run
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
from dflash_trt.train.feature_cache import TargetFeatures  # noqa: E402
from dflash_trt.train.prompts import Prompt  # noqa: E402
from dflash_trt.train.responses import generate_responses, read_records  # noqa: E402
from dflash_trt.train.trainer import TrainConfig, Trainer  # noqa: E402

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
    if args.smoke:
        from tests.conftest import make_target

        return make_target(work / "target", layers=4, seed=2)
    from dflash_trt.convert import convert_gguf

    out = work / "target"
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


def copy_out(src: Path, dst_dir: Path, part_bytes: int = 9 << 20) -> None:
    """Copy into the device's $OUT, which returns files of at most 16 MiB: larger ones go in parts
    (NAME.part0, NAME.part1, ...; `cat NAME.part* > NAME` joins them)."""
    data = src.read_bytes()
    if len(data) <= part_bytes:
        (dst_dir / src.name).write_bytes(data)
        return
    for i in range(0, len(data), part_bytes):
        (dst_dir / f"{src.name}.part{i // part_bytes}").write_bytes(data[i : i + part_bytes])


def smoke_prompts() -> list[Prompt]:
    words = ["red", "blue", "tea", "a cat", "rain", "wind", "snow", "music", "a ship", "gold", "a map", "salt"]
    return [Prompt(f"question {i}: what is {w}?", "smoke") for i, w in enumerate(words * 4)]


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-parts", help="comma-separated zstd parts of the GGUF (benchmarks/stage_gpu_training.py)")
    ap.add_argument("--tokenizer", help="directory with the CPU side's converted config.json and tokenizer files")
    ap.add_argument("--prompts", help="JSONL.gz of {text, source}: all training prompts in their stable order")
    ap.add_argument("--records", help="JSONL.gz of responses already generated (kept, extended)")
    ap.add_argument("--init-drafter")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/root/run")
    ap.add_argument("--gen-seconds", type=float, default=110)
    ap.add_argument("--train-seconds", type=float, default=320)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seqs-per-step", type=int, default=32)
    ap.add_argument("--gen-rows", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=300)  # an evaluation costs ~2 s on an H200
    ap.add_argument("--eval-prompts", type=int, default=8, help="0: pick the best drafter by held-out loss")
    ap.add_argument("--steer-anchors", type=float, default=0.0,
                    help="share of the anchors moved to where the drafter's next step would start (TrainConfig)")
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
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_target(target_dir, torch.bfloat16, device)
    print(f"target ready at {time.monotonic() - t_start:.0f} s", flush=True)

    # -- data -------------------------------------------------------------------------------------------
    data = work / "responses.jsonl"
    if args.records and not data.exists():
        with data.open("w") as f:
            for r in read_jsonl_gz(Path(args.records)):
                f.write(json.dumps(r) + "\n")
    prompts = smoke_prompts() if args.smoke else [Prompt(p["text"], p["source"]) for p in read_jsonl_gz(Path(args.prompts))]
    max_seq_len, max_new = (96, 24) if args.smoke else (640, 256)
    engine = LLMEngine(target, tokenizer, None, EngineConfig(max_batch_size=args.gen_rows, speculative=False,
                                                             dtype="bfloat16", device=device,
                                                             max_model_len=max_seq_len + max_new))
    before = len(read_records(data))
    t0 = time.monotonic()
    # Greedy answers to prompts not yet answered first (new prompts add more than new samples of old ones: the
    # first run's 1,024 responses were all sampled variants, jobs being ordered by prompt length), then samples.
    for variants in (0, 1):
        records = generate_responses(engine, prompts, data, max_new_tokens=max_new, sampled_variants=variants,
                                     batch_size=args.gen_rows, deadline=t0 + args.gen_seconds)
    gen_s = time.monotonic() - t0
    new = records[before:]
    new_tokens = sum(len(r["response_ids"]) for r in new)
    print(f"generated {len(new)} responses, {new_tokens} tokens in {gen_s:.0f} s ({new_tokens / gen_s:.0f} tok/s); "
          f"{len(records)} records in all", flush=True)
    with gzip.open(out / "responses.jsonl.gz", "wt") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    del engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    # -- train ------------------------------------------------------------------------------------------
    if args.smoke:
        from dflash_trt.train.cli import choose_mask_token

        init, layer_ids, mask_id = None, [1, 2], choose_mask_token(tokenizer, records, target.config.vocab_size)
    else:
        init = args.init_drafter
        dcfg = json.loads((Path(init) / "config.json").read_text())["dflash_config"]
        layer_ids, mask_id = dcfg["target_layer_ids"], dcfg["mask_token_id"]
    cfg = TrainConfig(num_layers=1 if args.smoke else 2, block_size=args.block_size, target_layer_ids=layer_ids,
                      mask_token_id=mask_id, steps=1_000_000, lr=args.lr, warmup_ratio=0.03,
                      seqs_per_step=args.seqs_per_step, anchors_per_seq=32, max_seq_len=max_seq_len,
                      eval_every=40 if args.smoke else args.eval_every, eval_prompts=args.eval_prompts, eval_new_tokens=96,
                      time_budget_s=args.train_seconds, init_drafter=init, steer_anchors=args.steer_anchors)
    trainer = Trainer(target, target_dir, tokenizer, records, TargetFeatures(target, layer_ids), work / "out", cfg)
    t0 = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - t0
    log = [json.loads(x) for x in (work / "out" / "train_log.jsonl").read_text().splitlines()]
    evals = [e for e in log if "val_tau" in e]
    (out / "drafter").mkdir(exist_ok=True)
    for f in (work / "out" / "drafter").iterdir():
        copy_out(f, out / "drafter")
    shutil.copy(work / "out" / "train_log.jsonl", out / "train_log.jsonl")
    print(f"\ntrained {trainer.step} steps x {cfg.seqs_per_step} sequences in {train_s:.0f} s "
          f"({train_s / max(trainer.step, 1) * 1e3:.0f} ms/step); first loss {log[0]['loss']:.3f}, "
          f"last 50 mean {sum(e['loss'] for e in log[-50:]) / len(log[-50:]):.3f}")
    for e in evals:
        print(f"step {e['step']:6d}  val_loss {e['val_loss']:.3f}  val_tau {e['val_tau']:.3f}")
    print(f"best held-out score (tau, or -loss) {trainer.best_score:.3f}; total {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
