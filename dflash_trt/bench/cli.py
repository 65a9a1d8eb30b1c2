"""`dflash-trt bench speed|sweep|plot`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from dflash_trt.bench.datasets import PRESETS


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from e
    if not values or min(values) < 0:
        raise click.BadParameter(f"expected comma-separated non-negative integers, got {text!r}", param_hint=name)
    return values


@click.group()
def bench() -> None:
    """Benchmarks: single-stream speed per category, load sweeps against an endpoint, Pareto plots."""


@bench.command()
@click.argument("engine", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--target", type=click.Path(exists=True, file_okay=False), help="HF-format target instead of ENGINE (default: the embedded SmolLM2).")
@click.option("--drafter", type=click.Path(exists=True, file_okay=False), help="z-lab-format drafter (default: the engine's, or the shipped one).")
@click.option("--dataset", default="categories", show_default=True, help=f"Built-in ({', '.join(PRESETS)}) or a .jsonl file.")
@click.option("--category", "categories", multiple=True, help="Only these categories (repeatable).")
@click.option("--limit-per-category", type=int, default=None, help="At most N prompts per category.")
@click.option("--max-tokens", type=int, default=None, help="Output tokens per prompt (default: the dataset's).")
@click.option("--draft-lens", "-k", default="3,7", show_default=True, help="K values to measure, e.g. 3,7,15.")
@click.option("--rounds", type=int, default=2, show_default=True, help="Timed rounds (the median is reported).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="bfloat16", show_default=True)
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
@click.option("--zlab-peer", is_flag=True, help="Also time z-lab's dflash_generate on the same weights (first K).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the JSON result here.")
def speed(engine, target, drafter, dataset, categories, limit_per_category, max_tokens, draft_lens, rounds, dtype,
          threads, zlab_peer, as_json, output) -> None:
    """Autoregressive vs DFlash at batch 1, greedy, per prompt category: tau, histogram, tok/s, speedup."""
    import torch
    from tqdm import tqdm

    from dflash_trt.bench.datasets import load_dataset
    from dflash_trt.bench.speed import SpeedConfig, format_table, run_speed, zlab_runner
    from dflash_trt.server.cli import load_engine

    if threads:
        torch.set_num_threads(threads)
    ks = _ints(draft_lens, "--draft-lens")
    try:
        eng, name = load_engine(engine, target, drafter, False, dtype=dtype, max_batch_size=1)
        prompts = load_dataset(dataset, osl=max_tokens, tokenizer=eng.tokenizer, categories=list(categories) or None,
                               limit_per_category=limit_per_category)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    if max(ks) > eng.max_draft_len:
        raise click.BadParameter(f"K={max(ks)} exceeds the drafter's limit {eng.max_draft_len}", param_hint="--draft-lens")
    zlab = None
    if zlab_peer:
        from dflash_trt.cli import _default_dirs

        tdir, ddir = (eng_dirs(engine) if engine else _default_dirs(target, drafter, False))
        zlab = zlab_runner(str(tdir), str(ddir), eng.config.torch_dtype, list(eng.eos_token_ids))
    cfg = SpeedConfig(draft_lens=ks, rounds=rounds, zlab_peer=zlab_peer)
    with tqdm(total=rounds * len(prompts), desc="bench speed", unit="prompt", disable=as_json) as bar:
        result = run_speed(eng, prompts, cfg, chat=bool(getattr(eng.tokenizer, "chat_template", None)), zlab=zlab,
                           progress=bar.update)
    result = {"model": name, "dataset": dataset, "dtype": dtype, "draft_lens": ks, "rounds": rounds,
              "prompts": len(prompts), "threads": torch.get_num_threads(), **result}
    if output:
        Path(output).write_text(json.dumps(result, indent=2) + "\n")
    click.echo(json.dumps(result) if as_json else format_table(result))


def eng_dirs(engine_dir: str) -> tuple[Path, Path | None]:
    from dflash_trt.engine_dir import EngineDir

    e = EngineDir(engine_dir)
    return e.target_dir, e.drafter_dir
