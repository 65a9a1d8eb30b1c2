"""`dflash-trt build` and `dflash-trt inspect`: flags -> build config overrides -> dflash_trt.build."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import click

GB = 10**9
# click's ctx.meta key for the user's own choice, read before the CLI sets its default HF_HUB_OFFLINE=1
HUB_OFFLINE_ASKED = "dflash_trt.hub_offline_asked"


def hub_offline_asked(environ: Mapping[str, str]) -> bool:
    """Whether ENVIRON asks for no Hub access, as huggingface_hub reads its variables."""
    value = environ.get("HF_HUB_OFFLINE") or environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in {"1", "ON", "YES", "TRUE"}


class EnginePath(click.Path):
    """An existing engine directory; where a build killed between its two renames left none, the error says where
    the previous engine was set aside, and how to put it back."""

    def __init__(self) -> None:
        super().__init__(exists=True, file_okay=False)

    def convert(self, value, param, ctx):
        from dflash_trt import dir_swap
        from dflash_trt.engine_dir import BUILD_REPLACED, MANIFEST

        path = Path(value)
        if not path.exists() and path.name and path.parent.is_dir():
            aside = [d for d in dir_swap.set_aside(path.parent, BUILD_REPLACED, path.name) if (d / MANIFEST).is_file()]
            if aside:
                self.fail(f"{path} does not exist: a build killed while it replaced it left the previous engine at "
                          f"{aside[0]}; the same build again puts it back (or move it back yourself)", param, ctx)
        return super().convert(value, param, ctx)


def _table(rows: list[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _by_batch_size(spec: dict, key: str, unit: str, none: str) -> str:
    """A batch size -> value table of the speculative config, and its *_without_amx twin where there is one."""

    def table(t: dict) -> str:
        return "{" + ", ".join(f"{b}: {n}" for b, n in sorted(t.items(), key=lambda kv: int(kv[0]))) + "}"

    main, without_amx = spec.get(key), spec.get(f"{key}_without_amx")
    text = f"{table(main)} (batch size -> {unit})" if main else none
    if without_amx is not None:
        text += f"; on CPUs without AMX {table(without_amx) if without_amx else none}"
    return text


def _tree(spec: dict | None) -> str:
    spec = spec or {}
    text = _by_batch_size(spec, "draft_tree", "nodes", "none (chains)")
    if spec.get("lookup_nodes"):
        text += f"; with context lookup branches of up to {spec['lookup_nodes']} tokens"
    return text


def format_plan(plan: dict) -> str:
    hw = plan["hardware"]
    head = [
        ("hardware", f"{hw['name']}: {hw['memory_bytes'] / GB:.1f} GB per device ({hw['description']})"),
        ("layout", f"{plan['layout']} (world size {plan['world_size']}, attention TP {plan['attention_tp']}, "
                   f"MoE EP {plan['moe_expert_parallel_size']} x TP {plan['moe_tensor_parallel_size']})"),
        ("dtype / KV cache", f"{plan['dtype']} / {plan['kv_cache_dtype']}"),
        ("max_batch_size x max_seq_len", f"{plan['max_batch_size_per_rank']} x {plan['max_seq_len']} per rank"),
        ("K (max_draft_len)", str(plan["max_draft_len"])),
        ("draft_len_schedule", _schedule(plan["draft_len_schedule"], plan["max_draft_len"])),
    ]
    gpu = hw.get("kind") == "gpu"
    if not gpu and plan.get("draft_len_schedule_without_amx") is not None:  # the one this CPU runs marked
        from dflash_trt.hardware import has_amx_tiles

        amx = has_amx_tiles()
        head[-1] = ("draft_len_schedule", head[-1][1] + (" (this CPU: AMX tiles)" if amx else ""))
        head.append(("  without AMX tiles", _schedule(plan["draft_len_schedule_without_amx"], plan["max_draft_len"])
                     + ("" if amx else " (this CPU)")))
    if gpu:  # the torch layout captures no CUDA graphs
        head.append(("CUDA-graph batch sizes", ", ".join(map(str, plan["cuda_graph_batch_sizes"])) or "-"))
    # a CPU's plan has no CUDA-graph pools: no row for them
    comps = [(k, f"{v / GB:9.3f} GB") for k, v in plan["components"].items() if gpu or k != "cuda_graph_pools"]
    comps.append(("total per rank", f"{plan['total_bytes'] / GB:9.3f} GB of {plan['memory_bytes'] / GB:.1f} GB"))
    comps.append(("KV cache budget", f"{plan['kv_cache_budget_bytes'] / GB:9.3f} GB"))
    out = [_table(head, "Plan"), _table(comps, "Memory per rank"),
           f"fits: {'yes' if plan['fits'] else 'NO'}"]
    out += [f"problem: {p}" for p in plan["problems"]] + [f"note: {n}" for n in plan["notes"]]
    text = "\n\n".join(out[:2]) + "\n\n" + "\n".join(out[2:])
    perf = plan.get("performance")
    return text + ("\n\n" + format_performance(perf, "GPU" if gpu else "device") if perf else "")


def format_performance(perf: dict, unit: str = "GPU", max_rows: int = 12) -> str:
    """Predicted autoregressive vs scheduled-K throughput per batch size (the plan's performance section)."""
    fmt = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    rows: dict[int, dict] = {}
    for p in perf["points"]:
        r = rows.setdefault(p["batch_size"], {})
        if p["draft_len"] == 0:
            r["ar"] = p
        if p["chosen"]:
            r["chosen"] = p
    sizes = sorted(rows)
    if len(sizes) > max_rows:  # keep the ends and an even spread between
        step = (len(sizes) - 1) / (max_rows - 1)
        sizes = sorted({sizes[round(i * step)] for i in range(max_rows)})
    per = f"tok/s/{unit}"  # tok/s/GPU on a GPU profile; a CPU is one device
    lines = [f"{'batch':>6} {'K':>3} {'step ms':>8} {'tok/s/user':>11} {per:>13}   "
             f"{'AR tok/s/user':>13} {'AR ' + per:>16}"]
    for b in sizes:
        ar, ch = rows[b]["ar"], rows[b].get("chosen", rows[b]["ar"])
        lines.append(f"{b:>6} {ch['draft_len']:>3} {ch['step_time_s'] * 1e3:>8.2f} {fmt(ch['tok_s_user']):>11} "
                     f"{fmt(ch['tok_s_gpu']):>13}   {fmt(ar['tok_s_user']):>13} {fmt(ar['tok_s_gpu']):>16}")
    ranks = perf["attention_dp_ranks"]
    per_rank = f", batch per rank of {ranks} attention-DP ranks: concurrency {ranks} x batch" if ranks > 1 else ""
    title = (f"Predicted per step (roofline{per_rank}, context {perf['context_len']} tokens, schedule "
             f"{perf['schedule_source'] or 'none'})")
    return (title + "\n" + "-" * len(title) + "\n" + "\n".join(lines)
            + f"\n(hardware figures: {perf['hardware']['perf_source']}; K as chains: a draft tree's other rows and "
            "their tau are not modelled)")


def _format_trtllm(options: dict) -> str:
    """The LLM-API options a build writes to trtllm/config.yaml, with the keys the pinned release refuses."""
    import yaml

    from dflash_trt.trtllm.llm_api_keys import TENSORRT_LLM_VERSION, release_notes

    title = f"TensorRT-LLM options (trtllm/config.yaml, for TensorRT-LLM {TENSORRT_LLM_VERSION})"
    notes = "".join(f"\n{note}" for note in release_notes(options))
    return title + "\n" + "-" * len(title) + "\n" + yaml.safe_dump(options, sort_keys=False).rstrip() + notes


def _schedule(table: dict | None, k: int = 0) -> str:
    """A batch size -> K table alike whether it comes from the planner (int keys) or plan.json (JSON's str keys);
    without one, what every batch size drafts."""
    if not table:
        return f"none (K={k} at every batch size)" if k else "none (no drafter)"
    return str({int(b): v for b, v in table.items()})


@click.command("build")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(file_okay=False), help="Engine directory to write.")
@click.option("--plan-only", is_flag=True, help="Validate and plan without converting or writing anything.")
@click.option("--drafter", help="Override speculative_config.speculative_model (HF id, or a directory: relative to "
              "the current directory here, where the YAML's own paths are relative to the YAML).")
@click.option("--max-batch-size", type=click.IntRange(min=1), help="Override max_batch_size.")
@click.option("--max-seq-len", "--max-model-len", "max_seq_len", type=click.IntRange(min=2),
              help="Override max_seq_len (the context of a request: serve's and generate's --max-model-len).")
@click.option("--max-draft-len", "-k", type=click.IntRange(min=1), help="Override speculative_config.max_draft_len "
              "(the file's draft_len_schedule and draft_len_schedule_without_amx are capped at it).")
@click.option("--force", is_flag=True, help="Replace an existing engine directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def build(config, output, plan_only, drafter, max_batch_size, max_seq_len, max_draft_len, force, as_json) -> None:
    """Validate, plan and write an engine directory from a build config (build_configs/*.yaml)."""
    from dflash_trt.build import build_engine, prepare_build
    from dflash_trt.engine_dir import EngineDir
    from dflash_trt.model_source import is_local_ref

    # anything on disk is a path (a file too: resolving it names it as a file, not as an HF id to download)
    if drafter is not None and (is_local_ref(drafter) or Path(drafter).expanduser().exists()):
        drafter = str(Path(drafter).expanduser().resolve())  # a path on the command line is the shell's, not the YAML's
    elif drafter is not None and drafter.count("/") != 1:
        raise click.BadParameter(f"{drafter!r} is neither a directory nor an HF id (org/name)", param_hint="--drafter")
    overrides = {"speculative_config.speculative_model": drafter, "max_batch_size": max_batch_size,
                 "max_seq_len": max_seq_len, "speculative_config.max_draft_len": max_draft_len}
    try:
        if plan_only:
            if output is not None:
                raise click.UsageError("--plan-only writes nothing: drop -o/--output (or --plan-only to build)")
            asked = click.get_current_context().meta.get(HUB_OFFLINE_ASKED, hub_offline_asked(os.environ))
            prepared = prepare_build(config, overrides, allow_bundled=True, fetch_configs=not asked)
            plan, options = prepared.plan.to_dict(), prepared.trtllm_options
        else:
            if output is None:
                raise click.UsageError("pass -o DIR (or --plan-only)")
            path = build_engine(config, output, overrides, force=force)
            plan = EngineDir(path).plan
    except (ValueError, OSError, RuntimeError) as e:
        # the system's own errors (a full disk, a read-only -o) come without the engine they stopped
        where = f" (building {output})" if isinstance(e, OSError) and e.errno and not e.filename else ""
        raise click.ClickException(f"{e}{where}") from e
    if plan_only:  # what trtllm/config.yaml would hold, shown before any weight is fetched or copied
        click.echo(json.dumps({**plan, "trtllm_options": options}, indent=2) if as_json
                   else format_plan(plan) + "\n\n" + _format_trtllm(options))
    else:
        click.echo(json.dumps(plan, indent=2) if as_json else format_plan(plan))
        click.echo(f"\nengine written to {path}", err=True)


@click.command("inspect")
@click.argument("engine", type=EnginePath())
@click.option("--verify", is_flag=True, help="Also check the sha256 of every file.")
def inspect(engine, verify) -> None:
    """Print an engine directory's manifest and memory plan as tables."""
    from dflash_trt.engine_dir import MANIFEST, EngineDir

    where = Path(engine) / MANIFEST
    try:
        e = EngineDir(engine)
        if verify:
            e.verify(rehash=True)
        try:
            rows = _manifest_rows(e.manifest, verify)
            where = e.path / "plan.json"
            plan = format_plan(e.plan)
        except (KeyError, TypeError, AttributeError, IndexError) as err:  # edited by hand, or by another version
            e.check_format()  # another format version: that is the reason
            what = (f"missing key {err.args[0]!r}" if isinstance(err, KeyError)
                    else f"not as dflash-trt writes it ({err})")
            raise click.ClickException(f"{where}: {what}; rebuild the engine") from err
    except (ValueError, OSError) as err:
        raise click.ClickException(str(err)) from err
    click.echo(_table(rows, f"Engine {Path(engine)}"))
    click.echo()
    click.echo(plan)
    # shown, as inspect shows any engine, but not to be taken for one this version runs as it stands
    for check in (e.check_format, e.check_digest, e.check_sizes):
        try:
            check()
        except ValueError as err:
            click.echo(f"note: {err}", err=True)


def _manifest_rows(m: dict, verified: bool) -> list[tuple[str, str]]:
    """inspect's table rows; KeyError naming the first manifest key it lacks."""
    t, d = m["target"], m.get("drafter")
    src = m["sources"]
    return [
        ("name", m["name"]), ("format version", str(m["format_version"])), ("created", m["created"]),
        ("target", f"{src['target']['ref']} ({t['architecture']}, {_count(t['num_hidden_layers'], 'layer')}, "
                   f"hidden {t['hidden_size']}, vocab {t['vocab_size']}, {t['num_attention_heads']}/"
                   f"{t['num_key_value_heads']} heads of {t['head_dim']}, rope {t['rope_type']})"),
        ("drafter", "none" if d is None else
         f"{src['drafter']['ref']} ({_count(d['num_hidden_layers'], 'layer')}, block {d['block_size']}, "
         f"target_layer_ids {d['target_layer_ids']}, mask {d['mask_token_id']})"),
        ("target weights", "copied" if m["build_config"].get("target_weights") != "link" else
         f"symlinks to {src['target']['path']} (the engine breaks if those files move)"),
        ("K (max_draft_len)", str(m["max_draft_len"])),
        ("K by batch (torch)", _by_batch_size(m["build_config"].get("speculative_config") or {},
                                              "draft_len_schedule", "K", "none (K at every batch size)")),
        ("draft tree (torch)", _tree(m["build_config"].get("speculative_config"))),
        ("chat template", "yes" if m["tokenizer"]["chat_template"] else "no"),
        ("TensorRT-LLM target", m["trtllm"]["version"]),
        ("versions", ", ".join(f"{k} {v}" for k, v in m["versions"].items()
                               if k not in ("format_version", "tensorrt_llm_target"))),  # rows of their own
        ("files", f"{len(m['files'])}, {sum(f['size'] for f in m['files'].values()) / GB:.3f} GB"
                  + (" (sha256 verified)" if verified else "")),
    ]
