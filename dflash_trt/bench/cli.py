"""`dflash-trt bench speed|sweep|plot|merge|compare`."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import click

from dflash_trt.bench.datasets import PRESETS
from dflash_trt.runtime_device import THREADS_HELP, use_threads


MAX_SWEEP_REQUESTS = 1_000_000
# what a --url given as a whole endpoint ends with
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/chat/completions", "/completions", "/models")


def _ints(text: str, name: str, minimum: int = 0) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from e
    if not values or min(values) < minimum:
        raise click.BadParameter(f"expected comma-separated integers >= {minimum}, got {text!r}", param_hint=name)
    if len(set(values)) != len(values):
        raise click.BadParameter(f"{text!r} repeats a value", param_hint=name)
    return values


@click.group()
def bench() -> None:
    """Benchmarks: single-stream speed per category, load sweeps against an endpoint, Pareto plots."""


@bench.command()
@click.argument("engine", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--target", type=click.Path(exists=True, file_okay=False), help="HF-format target instead of ENGINE (default: the embedded SmolLM2).")
@click.option("--drafter", type=click.Path(exists=True, file_okay=False),
              help="z-lab-format drafter, required with --target (without --target: the embedded SmolLM2's "
              "shipped drafter).")
@click.option("--dataset", default="categories", show_default=True, help=f"Built-in ({', '.join(PRESETS)}) or a .jsonl file.")
@click.option("--category", "categories", multiple=True, help="Only these categories (repeatable).")
@click.option("--limit-per-category", type=click.IntRange(min=1), default=None, help="At most N prompts per category.")
@click.option("--max-tokens", "--max-new-tokens", "max_tokens", type=click.IntRange(min=1), default=None,
              help="Output tokens per prompt (default: the dataset's).")
@click.option("--draft-lens", "-k", default=None,
              help="K values to measure, e.g. 3,7,15, each up to the drafter's block_size - 1 (default: the K the "
              "ENGINE drafts at one row on this CPU, else 3,7 where the drafter allows them).")
@click.option("--draft-vocab-sizes", default="all", show_default=True,
              help="Draft vocabularies to compare at each K: all (the drafter's draft_vocab.json), 0 (the whole "
              "vocabulary) or N (its N most frequent tokens), e.g. all,0.")
@click.option("--tree-nodes", default=None,
              help="Draft tree sizes to compare at each K (spec/draft_tree.py; 0: a chain), e.g. 0,5 (default: the "
              "tree the ENGINE drafts at one row on this CPU, else a chain).")
@click.option("--lookup-nodes", default=None,
              help="Context lookups to compare at each K and tree (spec/context_lookup.py; 0: none), e.g. 0,7 "
              "(default: the ENGINE's lookup_nodes, else none).")
@click.option("--adaptive/--fixed-k", "--adaptive-draft-len/--fixed-draft-len", "adaptive", default=None,
              help="Let the DFlash systems run plain steps where those measure faster (their names end in "
              "'adaptive'; tau counts their speculative steps only), or draft every step (default: as the ENGINE "
              "does).")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="Timed rounds (the median is reported).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Sampling temperature of every system (0: greedy).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True,
              help="Nucleus sampling mass (1: off).")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="Top-k sampling (0: off).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Sampled, prompt i runs with seed SEED + i in every system.")
@click.option("--acceptance", type=click.Choice(["match", "rejection"]), default="match", show_default=True,
              help="Sampled, the lossless rule: match keeps a draft equal to the target's own sample (so seeded "
              "outputs equal AR's), rejection samples drafts and accepts by min(1, p/q).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None,
              help="Weights and activations of every system (default: the ENGINE's dtype, else bfloat16).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--zlab-peer", is_flag=True, help="Also time z-lab's dflash_generate on the same weights (first K). It "
              "drafts over the whole vocabulary: include 0 in --draft-vocab-sizes to compare like with like.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Write the JSON result here (missing folders are created).")
def speed(engine, target, drafter, dataset, categories, limit_per_category, max_tokens, draft_lens, draft_vocab_sizes,
          tree_nodes, lookup_nodes, adaptive, rounds, temperature, top_p, top_k, seed, acceptance, dtype, threads,
          zlab_peer, as_json, output) -> None:
    """Autoregressive vs DFlash at batch 1, greedy or sampled, per prompt category: tau, histogram, tok/s, speedup."""
    import torch
    from tqdm import tqdm

    from dflash_trt.bench.datasets import PRESETS, load_dataset
    from dflash_trt.bench.speed import SpeedConfig, format_table, run_speed, zlab_runner
    from dflash_trt.draft_schedule import expand
    from dflash_trt.server.cli import load_engine
    from dflash_trt.spec.draft_tree import check_tree_nodes
    from dflash_trt.spec.draft_vocab import cut_draft_vocab

    if engine and (target or drafter):
        raise click.UsageError("pass ENGINE or --target/--drafter, not both")
    if target and not drafter:
        raise click.UsageError("--target needs --drafter DIR: bench speed compares plain decoding with DFlash")
    if zlab_peer and temperature > 0:
        raise click.UsageError("--zlab-peer runs z-lab's dflash_generate, which is greedy only: drop --temperature")
    if zlab_peer:
        import importlib

        try:  # z-lab's package, not a dependency of this one: found missing before the model loads
            importlib.import_module("dflash.model")
        except ImportError as e:
            raise click.UsageError(f"--zlab-peer needs z-lab's dflash package ({e}): pip install --no-deps "
                                   "dflash==0.1.0") from None
    # every value is checked before the model loads and the run starts: a mistake must not cost a benchmark
    vocabs = parse_vocab_sizes(draft_vocab_sizes)
    ks = _ints(draft_lens, "--draft-lens", minimum=1) if draft_lens is not None else None
    trees = _ints(tree_nodes, "--tree-nodes") if tree_nodes is not None else None
    try:
        check_tree_nodes(max(trees or [0]), "a draft tree")
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tree-nodes") from e
    lookups = _ints(lookup_nodes, "--lookup-nodes") if lookup_nodes is not None else None
    chains_only = acceptance == "rejection" and temperature > 0  # that rule verifies sampled chains
    if chains_only and (any(trees or ()) or any(lookups or ())):
        flags = [f for f, v in (("--tree-nodes", trees), ("--lookup-nodes", lookups)) if any(v or ())]
        raise click.UsageError(f"{' and '.join(flags)} apply to greedy and --acceptance match requests; "
                               "--acceptance rejection drafts chains")
    dataset_args = dict(osl=max_tokens, categories=list(categories) or None, limit_per_category=limit_per_category)
    prompts = None
    if dataset not in PRESETS or PRESETS[dataset][0] is None:  # the long-context presets need the model's tokenizer
        try:
            prompts = load_dataset(dataset, **dataset_args)
        except ValueError as e:
            raise click.ClickException(str(e)) from e
    if output:
        _check_output_folder(output)
    use_threads(threads)
    try:
        eng, name = load_engine(engine, target, drafter, False, dtype=dtype if dtype or engine else "bfloat16",
                                max_batch_size=1)
        if prompts is None:
            prompts = load_dataset(dataset, tokenizer=eng.tokenizer, **dataset_args)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    except KeyboardInterrupt:
        click.echo("\nInterrupted while the model loaded: nothing measured" + (f", {output} not written" if output
                                                                                 else ""), err=True)
        raise SystemExit(130) from None
    if eng.drafter is None:
        raise click.UsageError(f"{name} has no drafter: bench speed compares plain decoding with DFlash")
    for size in vocabs:  # the drafter's list bounds them: its sibling engines would refuse more with a traceback
        try:
            cut_draft_vocab(eng.drafter.draft_vocab, size, key="size")
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--draft-vocab-sizes") from e
    if ks is None:
        # an ENGINE's K at one row on this CPU (its schedule's, or the one for CPUs without AMX), as it serves
        ks = ([eng.scheduler.config.draft_len_for(1)] if engine
              else ([k for k in (3, 7) if k <= eng.max_draft_len] or [eng.max_draft_len]))
    # each K runs in an engine of its own (speed.py), so an ENGINE's drafter bounds it as generate and serve's
    # --max-draft-len are bounded, not the K it was built with
    if max(ks) > eng.runner.max_draft_len:
        raise click.BadParameter(f"K={max(ks)} exceeds the drafter's limit {eng.runner.max_draft_len} (its "
                                 "block_size - 1)", param_hint="--draft-lens")
    zlab = None
    if zlab_peer:
        from dflash_trt.cli import _default_dirs

        tdir, ddir = (eng_dirs(engine) if engine else _default_dirs(target, drafter, False))  # a drafter: checked above
        zlab = zlab_runner(str(tdir), str(ddir), eng.config.torch_dtype, list(eng.eos_token_ids))
    # an ENGINE's tree and lookups at one row on this CPU, as it serves them (none for chains: named as what runs)
    if trees is None:
        trees = [expand(eng.draft_tree, 1) if engine and eng.draft_tree and not chains_only else 0]
    if lookups is None:
        lookups = [0 if chains_only else eng.config.lookup_nodes]
    if max(lookups) > eng.runner.max_draft_len:  # the sibling engines would refuse more with a traceback
        raise click.BadParameter(f"{max(lookups)} nodes exceed the drafter's limit {eng.runner.max_draft_len} (its "
                                 "block_size - 1)", param_hint="--lookup-nodes")
    cfg = SpeedConfig(draft_lens=ks, rounds=rounds, draft_vocab_sizes=vocabs, tree_nodes=trees, lookup_nodes=lookups,
                      adaptive=adaptive, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                      acceptance=acceptance)
    try:
        with tqdm(total=rounds * len(prompts), desc="bench speed", unit="prompt", disable=as_json) as bar:
            result = run_speed(eng, prompts, cfg, chat=bool(getattr(eng.tokenizer, "chat_template", None)),
                               zlab=zlab, progress=bar.update)
    except ValueError as e:  # a prompt the engine's context cannot hold: found before any system ran
        raise click.ClickException(str(e)) from e
    except KeyboardInterrupt:
        click.echo("\nInterrupted before a round finished: nothing measured" + (f", {output} not written" if output
                                                                                 else ""), err=True)
        raise SystemExit(130) from None
    from datetime import datetime, timezone

    from dflash_trt import dir_swap
    from dflash_trt.bench.sweep import machine_info

    result = {"model": name, "dataset": dataset, "dtype": eng.config.dtype, "draft_lens": ks, "tree_nodes": trees,
              "lookup_nodes": lookups, "rounds": rounds, "prompts": len(prompts), "threads": torch.get_num_threads(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(), **result}
    click.echo(json.dumps(result) if as_json else format_table(result))  # first: a failed write keeps the table
    if output:
        try:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            dir_swap.replace_file(output, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"), output=True)
        except OSError as e:
            raise click.ClickException(f"cannot write {output}: {e}") from e
    if stopped := result.get("interrupted"):
        click.echo(f"Interrupted: the figures are of the {stopped['rounds_done']} of {stopped['rounds']} rounds that "
                   "finished" + (f" ({output} holds them)" if output else ""), err=True)
        raise SystemExit(130)


def parse_vocab_sizes(text: str) -> list[int | None]:
    """'all,0,8192' -> [None, 0, 8192] (EngineConfig.draft_vocab_size values)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if item == "all":
            out.append(None)
        elif re.fullmatch(r"[0-9]+", item):
            out.append(int(item))
        else:
            raise click.BadParameter(f"{item!r} is not 'all' or a token count", param_hint="--draft-vocab-sizes")
    if len(set(out)) != len(out):
        raise click.BadParameter(f"{text!r} repeats a size", param_hint="--draft-vocab-sizes")
    return out


def eng_dirs(engine_dir: str) -> tuple[Path, Path | None]:
    from dflash_trt.engine_dir import EngineDir

    e = EngineDir(engine_dir)
    return e.target_dir, e.drafter_dir


def _json_object(text: str | None, option: str) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint=option) from e
    if not isinstance(value, dict):
        raise click.BadParameter(f"expected a JSON object, got {text!r}", param_hint=option)
    return value


@bench.command()
@click.option("--url", required=True, callback=lambda ctx, param, url: _endpoint_url(url),
              help="The endpoint: http://HOST:PORT (or .../v1) of any OpenAI-compatible server.")
@click.option("--model", default=None, help="The model name the endpoint serves (default: the first of its /v1/models).")
@click.option("--concurrency", "concurrencies", default="1,2,4,8", show_default=True, help="Concurrent streams per point, e.g. 1,2,4,8,16.")
@click.option("--dataset", default="cpu-small", show_default=True, help=f"Built-in ({', '.join(PRESETS)}) or a .jsonl file.")
@click.option("--category", "categories", multiple=True, help="Only these categories (repeatable).")
@click.option("--isl", type=click.IntRange(min=1), default=None, help="Input tokens per prompt (long-context prompts of real text).")
@click.option("--osl", type=click.IntRange(min=1), default=None, help="Output tokens per request (default: the dataset's; a cap with --stop-at-eos).")
@click.option("--prefix-len", type=click.IntRange(min=1), default=None,
              help="Every request starts with one system prompt of about this many tokens of real text (vLLM's "
              "--random-prefix-len): a server's prefix reuse shows in TTFT and in cached_input_tokens.")
@click.option("--turns", type=click.IntRange(min=1), default=1, show_default=True,
              help="Turns a conversation holds: each stream sends the prompts in conversations, a request the next "
              "user message after the earlier ones and their answers (vLLM's multi-turn benchmark): a server's "
              "prefix reuse shows in TTFT and in cached_input_tokens.")
@click.option("--tokenizer", default=None, help="Tokenizer (dir or HF id) to cut --isl prompts and --prefix-len "
              "exactly (default ~4 chars/token) and to count the output tokens of an endpoint that sends no usage "
              "(default: its chunks).")
@click.option("--requests-per-concurrency", type=click.IntRange(min=1), default=4, show_default=True, help="A point sends max(4, this x concurrency) requests (with --turns, whole conversations, at least one a "
              "stream).")
@click.option("--warmup", type=click.IntRange(min=0), default=None, help="Warm-up requests before the first point (default: its concurrency).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the order of the prompts.")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs behind the endpoint (for tokens/s/GPU).")
@click.option("--api", type=click.Choice(["chat", "completions"]), default="chat", show_default=True,
              help="/v1/chat/completions (the prompts as user messages) or /v1/completions (raw prompts).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Sampling temperature of every request (0: greedy).")
@click.option("--ignore-eos/--stop-at-eos", default=True, show_default=True,
              help="Generate exactly --osl tokens (the usual sweep convention) or stop at EOS like real traffic.")
@click.option("--extra-body", default=None, callback=lambda ctx, param, text: _json_object(text, "--extra-body"),
              help='More fields for every request, as a JSON object, e.g. \'{"top_p": 0.9, "top_k": 20}\' (recorded '
              "in the result's config; fields the sweep sets itself are refused).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds the endpoint may send nothing before a request fails.")
@click.option("--label", default=None, help="The run's name in plots (default: the model name).")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None,
              help="Sent as `Authorization: Bearer KEY` to an endpoint that wants one (serve --api-key, vLLM's); "
              "default: $OPENAI_API_KEY. Never written into the result.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="RESULT.json (a .csv is written beside it).")
def sweep(url, model, concurrencies, dataset, categories, isl, osl, prefix_len, turns, tokenizer,
          requests_per_concurrency, warmup, seed, gpus, api, temperature, ignore_eos, extra_body, timeout, label,
          api_key, output) -> None:
    """Drive an endpoint at each concurrency with bounded, reproducible load; per point TTFT, TPOT, ITL and
    end-to-end latency (p50/p90/p99), output tok/s, tok/s/user, tok/s/GPU and acceptance where reported."""
    from dflash_trt.bench.datasets import dataset_name, load_dataset, prompt_isl, shared_prefix
    from dflash_trt.bench.sweep import SweepConfig, SweepError, csv_path_of, run_sweep, write_results

    concurrencies = _ints(concurrencies, "--concurrency", minimum=1)
    if sum(concurrencies) * requests_per_concurrency > MAX_SWEEP_REQUESTS:  # prompts are gathered for them first
        raise click.BadParameter(f"{sum(concurrencies) * requests_per_concurrency:,} requests in all; at most "
                                 f"{MAX_SWEEP_REQUESTS:,} (lower --concurrency or --requests-per-concurrency)",
                                 param_hint="--concurrency")
    _check_output(output)  # before the sweep: a path that cannot be written must not cost one
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        local = Path(tokenizer).expanduser()
        if (local / "manifest.json").is_file() and (local / "tokenizer").is_dir():  # an engine: its target's
            local = local / "tokenizer"
        if local.exists():  # recorded as an absolute path: rounds given ./tok and /abs/tok are one workload
            tokenizer = str(local.resolve())
        elif tokenizer.count("/") > 1 or tokenizer.startswith((".", "/", "~")):
            # a path, not an HF id (gpt2, org/name): else Hugging Face's "Repo id must be in the form..." answers
            raise click.BadParameter(f"{tokenizer!r}: no such directory", param_hint="--tokenizer")
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError) as e:
            raise click.BadParameter(f"cannot load a tokenizer from {tokenizer!r}: {e}", param_hint="--tokenizer") from e
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = check_served(url, model, headers) if model else served_model(url, headers)
    long_isl = prompt_isl(dataset, isl)  # None: the prompts as written, which no tokenizer cut
    try:
        cfg = SweepConfig(url=url, model=model, concurrencies=concurrencies,
                          requests_per_concurrency=requests_per_concurrency, warmup_requests=warmup, seed=seed,
                          gpus=gpus, api=api, temperature=temperature, ignore_eos=ignore_eos, osl=osl,
                          label=label or model, extra_body=extra_body, timeout_s=timeout, isl=long_isl,
                          tokenizer=tokenizer if long_isl or prefix_len else None,
                          prefix=shared_prefix(prefix_len, tok) if prefix_len else "", prefix_len=prefix_len,
                          turns=turns)
        needed = cfg.num_warmup + sum(cfg.requests_at(c) for c in concurrencies)
        prompts = load_dataset(dataset, isl=isl, osl=osl, tokenizer=tok, categories=list(categories) or None,
                               min_prompts=needed)
    except ValueError as e:  # SweepConfig's extra_body is --extra-body here
        raise click.ClickException(str(e).replace("extra_body sets", "--extra-body sets")) from e

    def show(p: dict) -> None:
        click.echo(point_line(p), err=True)

    kept: list[int] = []  # points in the file written last

    def keep(result: dict) -> None:  # after every point: a later failure, or Ctrl-C, keeps what was measured
        try:
            write_results(result, output)
        except OSError as e:
            raise click.ClickException(f"cannot write {output}: {e}") from e
        kept.append(len(result["points"]))

    def held() -> str:
        if not kept:  # a result an earlier run wrote there is not overwritten by one that measured nothing
            return f" (no point was measured; {output} was not written)"
        points = "the point" if kept[-1] == 1 else f"the {kept[-1]} points"
        return f" ({output} holds {points} measured before it)"

    try:
        run_sweep(cfg, prompts, dataset=dataset_name(dataset, cfg.isl), on_point=show, on_result=keep,
                  count_tokens=None if tok is None else lambda text: len(tok.encode(text, add_special_tokens=False)),
                  headers=headers)
    except SweepError as e:
        raise click.ClickException(f"{e}{held()}") from e
    except KeyboardInterrupt:
        click.echo(f"\nInterrupted{held()}.", err=True)
        raise SystemExit(130) from None
    except OSError as e:  # connection refused and friends
        raise click.ClickException(f"{url}: {e}") from e
    click.echo(f"wrote {output} and {csv_path_of(output)}", err=True)


def point_line(p: dict) -> str:
    """A sweep point as the console shows it; "-" where a figure is undefined (null in the result: one-token
    answers have no TPOT, answers that end at once no TTFT), not a 0 that reads as measured."""
    def fig(value: float | None, width: int, digits: int, scale: float = 1.0) -> str:
        return f"{'-':>{width}}" if value is None else f"{value * scale:{width}.{digits}f}"

    acc = p["acceptance"]
    tau = f"  tau {acc['tau']:.2f}" if acc and acc.get("tau") else ""
    cached = (f"  {p['cached_input_tokens'] / p['input_tokens']:.0%} of prompt tokens cached"
              if p.get("cached_input_tokens") and p.get("input_tokens") else "")
    failed = f"  FAILED {p['num_failed']}" if p["num_failed"] else ""
    # what the figures rest on where it is not what they seem to: tokens counted from stream chunks (an endpoint that
    # sends no usage; a speculative one sends several tokens a chunk), prompts sent again (a prefix cache's hits)
    counted = {"chunks": "tokens counted by chunks: the endpoint sent no usage (--tokenizer counts its text)",
               "tokenizer": "tokens counted by the tokenizer: the endpoint sent no usage"}
    notes = ([counted[p["tokens_from"]]] if p["tokens_from"] in counted else []) + (
        [f"{p['repeated_prompts']} repeated prompts"] if p.get("repeated_prompts") else []) + (
        [f"{p['ended_early']} answers ended before max_tokens despite ignore_eos"] if p.get("ended_early") else []) + (
        [f"tau from /metrics over steps that made {acc['coverage']:.0%} of the tokens"]
        if acc and acc.get("source") == "metrics" and (acc.get("coverage") or 1) < 0.9 else [])
    return (f"c={p['concurrency']:<4} {p['output_tok_s']:8.1f} tok/s  {fig(p['tok_s_per_user'], 7, 1)} tok/s/user  "
            f"{p['tok_s_per_gpu']:8.1f} tok/s/GPU  TTFT p50 {fig(p['ttft_s']['p50'], 7, 0, 1000)} ms  "
            f"TPOT p50 {fig(p['tpot_s']['p50'], 6, 1, 1000)} ms{tau}{cached}{failed}"
            + (f"  ({'; '.join(notes)})" if notes else ""))


@bench.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The image to write; its extension picks the format (.png, .svg, .pdf, .jpg, ...; none: PNG).")
@click.option("--title", default=None, help="The plot's title (default: Throughput vs interactivity).")
def plot(runs, output, title) -> None:
    """Overlay sweep results as tokens/s/GPU against tokens/s/user, each run's Pareto frontier marked."""
    from dflash_trt.bench.plot import (
        UnsupportedFormat,
        caveats,
        distinct_labels,
        incomplete,
        load_runs,
        mark_incomplete,
        plot_pareto,
        plottable,
        stopped_why,
    )

    _check_output_folder(output)  # before the runs are read: a folder that is a file fails as it is made
    try:
        loaded = load_runs(runs)
        distinct_labels(loaded, runs)
        for run, name in zip(loaded, runs):
            if not run["points"]:
                click.echo(f"warning: {name} ({run['label']}) has no points{stopped_why(run)}: left out of the plot",
                           err=True)
            elif not plottable(run):
                click.echo(f"warning: {name} ({run['label']}) has no point with both axes (tok/s/user needs outputs "
                           "of 2 or more tokens): left out of the plot", err=True)
            elif incomplete(run) is not None:
                click.echo(f"warning: {name} ({run['label']}) is an incomplete sweep ({incomplete(run)}): "
                           "plotted with the points it has, marked (incomplete)", err=True)
            for note in caveats(run):
                click.echo(f"warning: {name} ({run['label']}): {note}", err=True)
        mark_incomplete(loaded)
        if not any(plottable(run) for run in loaded):
            raise click.ClickException("no run has a point to plot: nothing written")
        path = plot_pareto(loaded, output, title)
    except UnsupportedFormat as e:
        raise click.BadParameter(str(e), param_hint="--output") from e
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:
        raise click.ClickException(f"cannot write {output}: {e}") from e
    click.echo(f"wrote {path}", err=True)


@bench.command()
@click.argument("rounds", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="RUN.json (a .csv is written beside it).")
def merge(rounds, output) -> None:
    """Merge repeated sweeps of one system: per concurrency, the round with the median output tokens/s."""
    from dflash_trt.bench.plot import caveats, load_runs
    from dflash_trt.bench.rounds import merge_rounds
    from dflash_trt.bench.sweep import write_results

    _check_output(output, rewritten=False)
    try:
        loaded = load_runs(rounds)
        for run, name in zip(loaded, rounds):
            for note in caveats(run):
                click.echo(f"warning: {name}: {note}", err=True)
        merged = merge_rounds(loaded, names=list(rounds))
        paths = write_results(merged, output)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:
        raise click.ClickException(f"cannot write {output}: {e}") from e
    click.echo(f"wrote {paths[0]} and {paths[1]}", err=True)


@bench.command()
@click.argument("run", type=click.Path(exists=True, dir_okay=False))
@click.argument("base", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def compare(run, base, as_json) -> None:
    """RUN's output tokens/s over BASE's per concurrency; round by round where both are merged alternating rounds."""
    from dflash_trt.bench.plot import caveats, distinct_labels, incomplete, load_runs
    from dflash_trt.bench.rounds import compare_runs, workload_differences

    try:
        a, b = load_runs([run, base])
        distinct_labels([a, b], [run, base])
        rows = compare_runs(a, b, names=(run, base))
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    # warnings, not refusals: a comparison across workloads may be meant, but must not pass for a like-for-like one
    compared = {r["concurrency"] for r in rows}
    for (loaded, name), other in (((a, run), (b, base)), ((b, base), (a, run))):
        if incomplete(other[0]) is None:  # an incomplete sweep's missing points are named below
            left_out = sorted({int(p["concurrency"]) for p in loaded["points"]} - compared)
            if left_out:
                click.echo(f"warning: {name} measured concurrency {', '.join(map(str, left_out))}, which "
                           f"{other[1]} did not: left out", err=True)
    for loaded, name in ((a, run), (b, base)):
        if incomplete(loaded) is not None:
            click.echo(f"warning: {name} is an incomplete sweep ({incomplete(loaded)}): compared at the "
                       "concurrencies it measured", err=True)
        for note in caveats(loaded):
            click.echo(f"warning: {name}: {note}", err=True)
    differ = workload_differences(a, b, names=(run, base))
    if differ:
        click.echo(f"warning: {run} and {base} ran different workloads ({'; '.join(differ)}): the ratios are not "
                   "the systems' alone", err=True)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{a['label']} vs {b['label']} (output tok/s)")
    for r in rows:
        paired = (f"  rounds {' '.join(f'{x:.2f}' for x in r['paired_ratios'])} (median {r['paired_median']:.2f})"
                  if "paired_ratios" in r else "")
        click.echo(f"c={r['concurrency']:<4} {r['output_tok_s']:8.1f} vs {r['base_output_tok_s']:8.1f}  "
                   f"{r['ratio']:.2f}x{paired}")


def _endpoint_url(url: str) -> str:
    import httpx

    # without a scheme httpx fails with "unsupported protocol", which reads like a server fault
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"{url!r} has no scheme: pass http://{url}", param_hint="--url")
    try:
        port = httpx.URL(url).port
    except (httpx.InvalidURL, ValueError) as e:  # a port like 8o00
        raise click.BadParameter(f"{url!r} is not a URL: {e}", param_hint="--url") from e
    if port is not None and not 0 < port < 65536:
        raise click.BadParameter(f"{url!r}: port {port} is not in 1..65535", param_hint="--url")
    route = next((r for r in ROUTES if url.rstrip("/").endswith(r)), None)
    if route:  # the sweep adds its route to the server's address: this one would be asked for .../v1/models/v1/...
        raise click.BadParameter(f"{url!r} names the route {route}; pass the server's address, "
                                 f"{url.rstrip('/').removesuffix(route) or 'http://HOST:PORT'}", param_hint="--url")
    return url


def _check_output(output: str, rewritten: bool = True) -> None:
    """Refuse, before any work, a result path whose CSV would overwrite it or whose folder cannot be made; `rewritten`:
    the result is written again after every point (a sweep), not once (merge)."""
    from dflash_trt.bench.sweep import csv_path_of

    try:
        csv = csv_path_of(output)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--output") from e
    if Path(output).exists() and not Path(output).is_file():  # a FIFO's reader ends at the first of them
        why = ("a sweep writes its result again after every point, and a CSV beside it" if rewritten
               else f"the CSV is written beside it, as {csv}")
        raise click.BadParameter(f"{output} is no regular file: {why}", param_hint="--output")
    _check_output_folder(output)
    _check_output_folder(str(csv))  # written beside it, in that folder, even where the result is a link or a device


def _check_output_folder(output: str) -> None:
    """Refuse, naming --output, a result path whose folder could not be made or written (a file is made and removed in
    its nearest existing folder: os.access answers yes to root even in /proc). Nothing is left behind: the folder is
    made as the result is written. A link, character device or FIFO is written through in place
    (dir_swap.replace_file): it needs to be writable itself."""
    from dflash_trt import dir_swap

    path = Path(output)
    try:
        in_place = dir_swap.written_in_place(path)
    except OSError as e:  # a folder, a block device, a link the kernel does not let this user follow
        raise click.BadParameter(f"cannot use {path}: {e.strerror or e}", param_hint="--output") from e
    if in_place and path.exists():  # a link to none yet: its folder is checked below, as a new file's
        if not os.access(path, os.W_OK):
            raise click.BadParameter(f"{path} is not writable", param_hint="--output")
        return
    folder = Path(output).absolute().parent
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise click.BadParameter(f"{existing} is not a folder", param_hint="--output")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise click.BadParameter(f"cannot write in {existing}: {e.strerror or e}", param_hint="--output") from e


def _models_url(url: str) -> str:
    from dflash_trt.bench.sweep import server_root

    return server_root(url) + "/v1/models"


def _listed_models(url: str, headers: dict[str, str]) -> list[str]:
    """The model ids the endpoint's /v1/models lists; httpx's errors, or KeyError / TypeError / ValueError for an
    answer that is no model list, propagate."""
    import httpx

    answer = httpx.get(_models_url(url), headers=headers, timeout=30)
    if answer.status_code == 401:
        raise click.ClickException(f"{_models_url(url)}: the endpoint wants an API key (401): pass --api-key or set "
                                   "OPENAI_API_KEY" + (", another than this one" if headers else ""))
    return [m["id"] for m in answer.raise_for_status().json()["data"]]


def check_served(url: str, model: str, headers: dict[str, str]) -> str:
    """`model`, refused where the endpoint lists the models it serves and not this one (else every request of the
    sweep would fail on it); an endpoint that does not list them, or does not answer yet, is left to the sweep."""
    import httpx

    try:
        ids = _listed_models(url, headers)
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return model
    if ids and model not in ids:
        raise click.BadParameter(f"{model!r} is not served at {url} (it serves {', '.join(map(repr, ids))})",
                                 param_hint="--model")
    return model


def served_model(url: str, headers: dict[str, str]) -> str:
    """The first model id of an OpenAI-compatible endpoint's /v1/models."""
    import httpx

    models = _models_url(url)
    try:
        ids = _listed_models(url, headers)
    except httpx.TransportError as e:  # nothing answered: --model would not help
        raise click.ClickException(f"{models}: cannot reach the endpoint ({e}); is a server running at {url}?") from e
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
        raise click.ClickException(f"{models}: cannot list the served models ({e}); pass --model") from e
    if not ids:
        raise click.ClickException(f"{models}: the endpoint serves no model; pass --model")
    return ids[0]
