"""`dflash-trt` command line: flags -> config -> one function call per subcommand."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import click

from dflash_trt import __version__
from dflash_trt.build_cli import HUB_OFFLINE_ASKED, EnginePath, hub_offline_asked
from dflash_trt.runtime_device import DEVICE_HELP, DTYPE_HELP, THREADS_HELP, target_runtime, use_threads
from dflash_trt.sampling_params import SamplingParams


class _Commands(click.Group):
    """The command group: Ctrl-C where a command does not say more itself (loading torch, reading stdin) ends it
    with "interrupted" and a shell's status for SIGINT, not click's "Aborted!" and status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__)
@click.option("-v", "--verbose", is_flag=True, help="Log engine details (INFO).")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """Build, serve and benchmark DFlash speculative decoding."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # libraries stay off the network unless the user says otherwise; build --plan-only asks only if the user did not
    ctx.meta[HUB_OFFLINE_ASKED] = hub_offline_asked(os.environ)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _default_dirs(target: str | None, drafter: str | None, no_spec: bool) -> tuple[Path, Path | None]:
    from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir

    if target is None:
        target_dir = smollm2_dir()
        if drafter is None and not no_spec:
            if not (SMOLLM2_DRAFTER / "config.json").is_file():
                raise click.UsageError(f"no drafter at {SMOLLM2_DRAFTER}; pass --drafter DIR or --no-spec")
            drafter = str(SMOLLM2_DRAFTER)
    else:
        target_dir = Path(target)
    if not no_spec and drafter is None:
        raise click.UsageError("speculative decoding needs --drafter DIR (or pass --no-spec for plain decoding)")
    if no_spec and drafter is not None:  # one of the two was not meant
        raise click.UsageError("--no-spec decodes without a drafter: drop --drafter (or --no-spec)")
    return target_dir, (Path(drafter) if drafter and not no_spec else None)


# The engine's settings these flags set: its errors name the setting, which the user knows by the flag
_FLAG_OF = {"max_draft_len": "--max-draft-len", "draft_tree": "--tree-nodes", "lookup_nodes": "--lookup-nodes",
            "max_model_len": "--max-model-len"}


def _as_flags(message: str) -> str:
    """An engine error that names a setting (`max_model_len=128`), led by the flag that sets it."""
    key = next((k for k in _FLAG_OF if f"{k}=" in message), None)
    return f"{_FLAG_OF[key]}: {message}" if key else message


@main.command()
@click.argument("engine", required=False, type=EnginePath())
@click.option("--backend", type=click.Choice(["torch", "trtllm", "auto"]), default="auto", show_default=True,
              help="With ENGINE: this project's torch runtime, or TensorRT-LLM (auto: trtllm when importable on a GPU engine).")
@click.option("--target", type=click.Path(exists=True, file_okay=False), help="HF-format target directory (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--drafter", type=click.Path(exists=True, file_okay=False),
              help="z-lab-format DFlash drafter directory (default without --target: the embedded SmolLM2's shipped "
              "drafter, drafters/smollm2-135m-dflash).")
@click.option("-p", "--prompt", required=True, help="Prompt text; - reads it from stdin.")
@click.option("--chat", is_flag=True, help="Apply the tokenizer's chat template (with the generation prompt).")
@click.option("--max-new-tokens", "--max-tokens", "max_new_tokens", default=128, show_default=True,
              type=click.IntRange(min=1), help="Tokens to generate at most.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the end-of-sequence token.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0), help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(min=0, max=1, min_open=True),
              help="Nucleus sampling mass; 1 disables it.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 disables top-k.")
@click.option("--seed", default=None, type=int, help="Fixes a sampled answer: with --acceptance match, the same text "
              "at any K, with or without speculation (default: a fresh seed; with rejection, the text follows each "
              "step's drafts, which timing and reused prompt chunks change).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--acceptance", type=click.Choice(["match", "rejection"]), default="match", show_default=True,
              help="Sampling acceptance rule: target-sample-and-match, or rejection sampling with draft probabilities.")
@click.option("--max-draft-len", "-k", default=None, type=click.IntRange(min=1),
              help="K draft tokens per step (default: the engine's K with ENGINE, else the drafter's block_size - 1; "
              "with ENGINE its draft-length schedule is capped at K).")
@click.option("--tree-nodes", default=None, type=click.IntRange(min=0),
              help="Verify a draft tree of N nodes per step instead of a chain (spec/draft_tree.py); 0: a chain. "
              "Default: the engine's speculative_config.draft_tree (draft_tree_without_amx on a CPU without AMX "
              "tiles), else a chain.")
@click.option("--lookup-nodes", default=None, type=click.IntRange(min=0),
              help="Steps also weigh up to N tokens copied from the prompt or output where its last tokens occurred "
              "before (spec/context_lookup.py): in a tree's nodes, or as a chain's drafts, where likelier than the "
              "drafter's; 0: none. Default: the engine's speculative_config.lookup_nodes, else none.")
@click.option("--prediction", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A file the answer is expected to repeat much of (one it rewrites with a few changes; OpenAI's "
              "predicted outputs): drafted where the answer follows it. The answer is the target's own whatever it "
              "holds.")
@click.option("--no-spec", is_flag=True, help="Plain autoregressive decoding in the same runtime (no drafter needed).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None, help=DTYPE_HELP)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help=DEVICE_HELP)
@click.option("--max-model-len", default=None, type=click.IntRange(min=2),
              help="Prompt + generated tokens. Default: 4096, or the engine's max_seq_len with ENGINE.")
@click.option("--repetition-penalty", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Divides the logits of tokens the prompt or answer holds (vLLM's; 1: off).")
@click.option("--presence-penalty", default=0.0, show_default=True, type=click.FloatRange(-2, 2),
              help="Subtracted once from the logit of every token the answer holds (OpenAI's).")
@click.option("--frequency-penalty", default=0.0, show_default=True, type=click.FloatRange(-2, 2),
              help="Subtracted from a token's logit per time the answer holds it (OpenAI's).")
@click.option("--logprobs", default=None, type=click.IntRange(0, 20),
              help="With --json: each generated token's log-probability and its N likeliest alternatives.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def generate(engine, backend, target, drafter, prompt, chat, max_new_tokens, ignore_eos, temperature, top_p, top_k,
             seed, stop, acceptance, max_draft_len, tree_nodes, lookup_nodes, prediction, no_spec, dtype, device,
             max_model_len, repetition_penalty, presence_penalty, frequency_penalty, logprobs, threads,
             as_json) -> None:
    """Generate once (from ENGINE, a `dflash-trt build` directory, or --target/--drafter) and print the text
    with acceptance statistics."""
    from jinja2 import TemplateError

    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine, capped_note

    engine_path = engine
    if no_spec:
        refuse_drafting_flags({"--max-draft-len": max_draft_len, "--tree-nodes": tree_nodes,
                               "--lookup-nodes": lookup_nodes, "--prediction": prediction,
                               "--acceptance rejection": acceptance != "match"})
    if acceptance == "rejection" and temperature > 0 and (tree_nodes or lookup_nodes):
        # that rule's drafts are samples of the drafter, verified as chains: trees and lookups would be dropped unseen
        flags = [f for f, v in (("--tree-nodes", tree_nodes), ("--lookup-nodes", lookup_nodes)) if v]
        raise click.UsageError(f"{' and '.join(flags)} apply to greedy and --acceptance match requests; "
                               "--acceptance rejection drafts chains")
    if logprobs is not None and not as_json:
        raise click.UsageError("--logprobs come in the --json output: add --json")
    if prediction is not None:
        try:
            prediction = Path(prediction).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise click.BadParameter(f"{prediction} is not UTF-8 text (a byte at position {e.start})",
                                     param_hint="'--prediction'") from None
    if prompt == "-":
        try:  # bytes, decoded here: the text stream's UnicodeDecodeError would end in a traceback
            prompt = click.get_binary_stream("stdin").read().decode("utf-8").removesuffix("\n")  # `echo`'s newline
        except UnicodeDecodeError as e:
            raise click.BadParameter(f"stdin is not UTF-8 text (a byte at position {e.start})",
                                     param_hint="'--prompt'") from None
    if temperature > 0 and seed is None:  # drawn here, to be reported: a sample worth keeping can be had again
        import random

        seed = random.SystemRandom().randrange(2**31)
    for flag, text in (("--prompt", prompt), *(("--stop", x) for x in stop)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes the shell passed that are no UTF-8 (click keeps them as surrogates)
            raise click.BadParameter(f"not UTF-8 text (a byte at character {e.start}); pass text in the terminal's "
                                     "UTF-8", param_hint=f"'{flag}'") from None
    tree = None if tree_nodes is None else ({1: tree_nodes} if tree_nodes else {})
    use_threads(threads)
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=list(stop), ignore_eos=ignore_eos, acceptance=acceptance,
                                repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, logprobs=logprobs)
        if engine_path is not None:
            from dflash_trt.engine_dir import EngineDir, open_engine
            from dflash_trt.trtllm import launch

            if target or drafter:
                raise click.UsageError("pass either ENGINE or --target/--drafter, not both")
            built = EngineDir(engine_path)
            built.check_format()
            if backend == "auto":
                gpu = built.layout == "trtllm"
                backend = "trtllm" if gpu and launch.tensorrt_llm_available() else "torch"
            if backend == "trtllm":
                _refuse_unpassed_to_trtllm(options_given(click.get_current_context(), TRTLLM_GENERATE_TAKES))
                built.verify()
                text = launch.generate(built, [prompt], max_new_tokens, temperature, top_p, top_k, seed)[0]
                click.echo(json.dumps(text) if as_json else text["text"])
                return
            engine = open_engine(engine_path, "torch", max_batch_size=1, max_model_len=max_model_len,
                                 max_draft_len=max_draft_len, speculative=False if no_spec else None, dtype=dtype,
                                 device=device, draft_tree=tree, lookup_nodes=lookup_nodes)
        else:
            if backend == "trtllm":
                raise click.UsageError("--backend trtllm runs an engine directory: dflash-trt generate ENGINE ...")
            target_dir, drafter_dir = _default_dirs(target, drafter, no_spec)
            asked_dtype = dtype
            device, dtype = target_runtime(device, dtype)
            if target is None and asked_dtype is None and not no_spec and device == "cpu" and tree is None:
                click.echo("note: without an ENGINE the embedded SmolLM2 runs float32 in a chain, exact and slow on a "
                           "CPU; the CPU default engine (`make demo`, or `dflash-trt build "
                           "build_configs/smollm2-135m-cpu.yaml -o DIR`) runs bfloat16 with its draft tree", err=True)
            config = EngineConfig(max_batch_size=1, max_model_len=4096 if max_model_len is None else max_model_len,
                                  max_draft_len=max_draft_len, device=device,
                                  speculative=not no_spec, dtype=dtype, draft_tree=tree or {},
                                  lookup_nodes=lookup_nodes or 0)
            engine = LLMEngine.from_dirs(target_dir, drafter_dir, config)
        no_spec = no_spec or engine.drafter is None  # an engine built without a drafter decodes plainly
        if note := capped_note(max_model_len, engine.max_position_embeddings):
            click.echo(note, err=True)
        if prediction:
            params = dataclasses.replace(params, prediction=engine.tokenizer.encode(prediction,
                                                                                    add_special_tokens=False))
        try:
            ids = engine.encode(prompt, chat=chat)
        except TemplateError as e:  # jinja2's syntax and undefined errors, a template's own raise_exception
            raise click.ClickException(f"the tokenizer's chat template does not render: {type(e).__name__}: {e}") from e
        # else a "length" finish would not say which limit (a prompt that fills the context is the engine's error)
        if len(ids) < engine.max_model_len < len(ids) + max_new_tokens:
            click.echo(f"note: the prompt has {_count(len(ids), 'token')} and the context {engine.max_model_len} "
                       f"(--max-model-len): at most {_count(max(engine.max_model_len - len(ids), 0), 'new token')}, "
                       f"not {max_new_tokens}", err=True)
        out = engine.generate([ids], params)[0] if as_json else _stream(engine, ids, params)
    except (ValueError, OSError, RuntimeError) as e:
        raise click.ClickException(_as_flags(str(e))) from e
    except KeyboardInterrupt:  # loading, or a --json run (a streamed answer keeps its text: _stream)
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
    result = {
        "text": out.text,
        "token_ids": out.token_ids,
        "num_tokens": out.num_tokens,
        "finish_reason": out.finish_reason,
        "tau": round(out.tau, 4) if not no_spec and out.acceptance_lengths else None,  # no step ran: no tau
        "tokens_per_s": round(out.tokens_per_s, 3),
        "acceptance_histogram": out.acceptance_histogram,
        "acceptance_lengths": out.acceptance_lengths,
        "max_draft_len": engine.scheduler.config.draft_len_for(1),  # what a one-row step drafts on this device
        "seed": seed,  # given, or drawn for a sampled run; null for greedy
        "prefill_s": round(out.prefill_time, 4),
        "decode_s": round(out.decode_time, 4),
        "draft_s": round(out.draft_time, 4),
        "verify_s": round(out.verify_time, 4),
    }
    if out.logprobs is not None:
        result["logprobs"] = [{"token_id": e.token_id, "logprob": e.logprob, "top": [list(t) for t in e.top]}
                              for e in out.logprobs]
    if as_json:
        try:
            click.echo(json.dumps(result))
        except BrokenPipeError:
            _reader_gone()
        return
    click.echo("---", err=True)
    # the K a one-row step drafts on this CPU (an engine's schedule may draft less than its max_draft_len there)
    mode = ("autoregressive" if no_spec
            else f"DFlash K={engine.scheduler.config.draft_len_for(1)}" + _tree_text(engine, params))
    tau = ""
    if not no_spec:
        steps, drafted = len(out.acceptance_lengths), sum(out.acceptance_lengths)
        # the first token comes from the prompt's forward; the rest from speculative steps or, where the engine's
        # adaptive mode measured them faster (or a request's end left no room), plain ones
        plain = max(out.num_tokens - 1 - drafted, 0)
        ran = f", tau {out.tau:.2f} over {_count(steps, 'speculative step')}" if steps else ", no speculative step"
        tau = ran + (f", {_count(plain, 'token')} from plain steps" if plain else "")
    click.echo(f"{mode}: {_count(out.num_tokens, 'token')} ({out.finish_reason}){tau}, "
               f"{out.tokens_per_s:.1f} tok/s decode, "
               f"prefill {out.prefill_time * 1000:.0f} ms" + (f", seed {seed}" if temperature > 0 else ""), err=True)
    if not no_spec and out.acceptance_lengths:  # no speculative step ran: nothing to tally
        hist = " ".join(f"{i + 1}:{c}" for i, c in enumerate(out.acceptance_histogram) if c)
        click.echo(f"acceptance histogram (tokens per step: steps): {hist}", err=True)
        click.echo(f"draft {out.draft_time * 1000:.0f} ms, verify {out.verify_time * 1000:.0f} ms", err=True)


def _stream(engine, ids: list[int], params: SamplingParams):
    """The answer, its text written to stdout as the steps make it; Ctrl-C ends it there, what came kept (exit 130).
    A reader that goes away (`| head`) ends it quietly, as it would a Unix tool."""
    tokens = 0
    try:
        for chunk in engine.stream(ids, params):
            click.echo(chunk.text, nl=False)
            tokens = chunk.num_tokens
            if chunk.output is not None:
                click.echo()
                return chunk.output
    except KeyboardInterrupt:
        click.echo()
        click.echo(f"--- interrupted after {_count(tokens, 'token')}", err=True)
        sys.exit(130)
    except BrokenPipeError:
        _reader_gone()


def _reader_gone() -> None:
    """Exit as a Unix tool whose reader went away (`| head`): quietly, with a shell's status for SIGPIPE."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the exit's flush fails on it again
    sys.exit(141)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _tree_text(engine, params: SamplingParams) -> str:
    """What a one-row step verifies besides K: the draft tree's nodes and the context lookups, as the engine runs
    them on this CPU (draft_tree_without_amx where it has no AMX tiles) for this request (trees verify greedy and
    "match" rows only: a "rejection" row drafts a chain)."""
    from dflash_trt.draft_schedule import expand

    tree_row = not params.samples_drafts
    nodes = expand(engine.draft_tree, 1) if engine.draft_tree and tree_row else 0
    lookups = engine.runner.lookup_nodes if tree_row else 0
    return (f", tree of {nodes} nodes" if nodes else "") + (f", lookups of up to {lookups}" if lookups else "")


def given_flags(flags: dict[str, object]) -> list[str]:
    """The flags of {flag: value} a user gave: not None, False or an empty multiple option."""
    return [flag for flag, value in flags.items() if value not in (None, False, ())]


def refuse_drafting_flags(flags: dict[str, object]) -> None:
    """--no-spec decodes plainly: a drafting flag beside it is a contradiction, as --drafter is, not a no-op."""
    given = given_flags(flags)
    if given:
        raise click.UsageError(f"--no-spec decodes without drafts: drop {', '.join(given)} (or --no-spec)")


def options_given(ctx: click.Context, taken: set[str]) -> list[str]:
    """The options of ctx's command set to other than their defaults, but for the parameters named in `taken`, as a
    user spells them (an on/off pair by the side given): what a path that passes on only `taken` would drop."""
    given = []
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in taken:
            continue
        value = ctx.params.get(param.name)
        if value is None or value == () or value == param.get_default(ctx):
            continue
        off = value is False and param.secondary_opts  # an on/off pair given off (its default None)
        given.append(max(param.secondary_opts if off else param.opts, key=len))
    return given


# What `generate --backend trtllm` passes on to tensorrt_llm.LLM (launch.generate), or checks itself
TRTLLM_GENERATE_TAKES = {"backend", "target", "drafter", "prompt", "max_new_tokens", "temperature", "top_p", "top_k",
                         "seed", "as_json"}


def _refuse_unpassed_to_trtllm(dropped: list[str]) -> None:
    """`--backend trtllm` generates through tensorrt_llm.LLM with the prompt as is and max_tokens, temperature,
    top_p, top_k and seed only: a flag it would drop must not be silently ignored."""
    if dropped:
        raise click.UsageError(
            f"the TensorRT-LLM backend does not take {', '.join(dropped)} here (it passes the prompt as is with "
            "--max-new-tokens, --temperature, --top-p, --top-k and --seed); use --backend torch, or drop them"
        )


from dflash_trt.train.cli import train as _train  # noqa: E402

main.add_command(_train)

from dflash_trt.build_cli import build as _build, inspect as _inspect  # noqa: E402

main.add_command(_build)
main.add_command(_inspect)

from dflash_trt.server.cli import serve as _serve, triton as _triton  # noqa: E402

main.add_command(_serve)
main.add_command(_triton)

from dflash_trt.bench.cli import bench as _bench  # noqa: E402

main.add_command(_bench)

if __name__ == "__main__":
    sys.exit(main())
