"""Prefill a prompt once, on the CPU default: two cases, each against the same work without it, side by side in one
process.

--case n-answers: a request's n answers. The engine (SmolLM2-135M-Instruct, bf16, the shipped drafter, n rows, 2
threads) samples n seeded answers of --max-tokens to a --prompt-len-token window of the bundled benchmark prompts'
text (prefilled once, the others copying its K/V), against n windows of that text at different offsets, as long
(each prefilled). Both decode the same number of tokens (ignore_eos), so what differs is the prefill. Timed: the whole
request, and until every answer has its first token.

--case next-turn: a chat's next turn. One row; a --prompt-len-token prompt is answered (--max-tokens), then the next
turn (that prompt, its answer and a short new message) is sent: its row holds the first prompt's whole chunks and
takes them over, against the same next turn after `Scheduler.forget_resident()` (prefilled from the start). Timed:
the next turn's first token.

--case shared-system: users' requests that start with one system prompt. Two rows; a request (a --prompt-len-token
system prompt and a question) runs, and once it has drafted, another user's request arrives: the same system prompt
and another question (it copies the running row's whole chunks), against a system prompt of other tokens, as long
(prefilled from the start). Timed: the second request's first token.

Per round, each arm once, in alternation after one warm-up each; the record holds every round and the medians.

    .venv/bin/python benchmarks/bench_prompt_reuse.py [--case n-answers] [--n 8] [--prompt-len 480]
        [--max-tokens 32] [--rounds 5] [--name prompt_reuse_cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

import dflash_trt  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.sampling_params import SamplingParams  # noqa: E402


def n_answers(engine: LLMEngine, text: list[int], args) -> dict:
    """Arms -> a run each, returning its timings: a request's n answers to one prompt, and n prompts."""
    stride = (len(text) - args.prompt_len) // max(args.n - 1, 1)
    if stride < 1:
        raise SystemExit(f"the prompt text holds {len(text)} tokens: too few for {args.n} windows of --prompt-len")
    params = [SamplingParams(max_new_tokens=args.max_tokens, temperature=0.8, seed=s, ignore_eos=True)
              for s in range(args.n)]

    def run(prompts: list[list[int]]) -> dict:
        engine.scheduler.forget_resident()  # the copies alone: nothing left in the rows by the round before
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return {"total_s": time.perf_counter() - start, "last_first_token_s": max(o.time_to_first_token for o in outs)}

    copies = [text[: args.prompt_len]] * args.n
    windows = [text[i * stride: i * stride + args.prompt_len] for i in range(args.n)]
    return {"one prompt, n copies": lambda: run(copies), "n prompts": lambda: run(windows)}


def next_turn(engine: LLMEngine, text: list[int], args) -> dict:
    """Arms -> a run each: a chat's next turn into the row its first turn left, and from the start."""
    greedy = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    first = text[: args.prompt_len]
    following = first + engine.generate([first], greedy)[0].token_ids + engine.encode("\nAnd what comes next?")

    def run(forget: bool) -> dict:
        engine.scheduler.forget_resident()
        engine.generate([first], greedy)
        if forget:
            engine.scheduler.forget_resident()
        (out,) = engine.generate([following], SamplingParams(max_new_tokens=1))
        return {"first_token_s": out.time_to_first_token, "cached_tokens": out.num_cached_tokens}

    return {"taken over": lambda: run(False), "from the start": lambda: run(True)}


def shared_system(engine: LLMEngine, text: list[int], args) -> dict:
    """Arms -> a run each: a request arriving while another with its system prompt runs, and with another one."""
    if len(text) - args.prompt_len < engine.scheduler.config.grid:
        raise SystemExit(f"the prompt text holds {len(text)} tokens: too few for two system prompts of --prompt-len "
                         "that differ in their first chunk")
    system, other = text[: args.prompt_len], text[-args.prompt_len:]
    first_prompt = system + engine.encode("\nUser: Which of these comes first?")
    question = engine.encode("\nUser: Sum these up in a line.")

    def run(second_system: list[int]) -> dict:
        engine.scheduler.forget_resident()
        first = engine.add_request(first_prompt, SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True))
        while first.drafter_context < len(first_prompt):  # prefilled, and drafted from: its row holds its chunks
            engine.step()
        second = engine.add_request(second_system + question, SamplingParams(max_new_tokens=1))
        while engine.has_unfinished():
            engine.step()
        out = engine.make_output(second)
        return {"first_token_s": out.time_to_first_token, "cached_tokens": out.num_cached_tokens}

    return {"copied from the running row": lambda: run(system), "another system prompt": lambda: run(other)}


CASES = {"n-answers": (n_answers, 8), "next-turn": (next_turn, 1), "shared-system": (shared_system, 2)}  # (arms, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), default="n-answers")
    ap.add_argument("--n", type=int, default=8, help="n-answers: answers (and rows)")
    ap.add_argument("--prompt-len", type=int, default=480)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="prompt_reuse_cpu")
    args = ap.parse_args()

    torch.set_num_threads(2)
    make_arms, rows = CASES[args.case]
    rows = args.n if args.case == "n-answers" else rows
    engine = LLMEngine.from_dirs(smollm2_dir(), SMOLLM2_DRAFTER, EngineConfig(dtype="bfloat16", max_batch_size=rows))
    text = engine.encode((Path(dflash_trt.__file__).parent / "bench" / "prompts.jsonl").read_text())
    if len(text) < args.prompt_len:
        raise SystemExit(f"the prompt text holds {len(text)} tokens, fewer than --prompt-len {args.prompt_len}")
    arms = make_arms(engine, text, args)
    for arm in arms.values():  # warm-up: oneDNN's primitives for every shape
        arm()
    rounds = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, arm in arms.items():
            got = {key: round(value, 4) for key, value in arm().items()}
            rounds[name].append(got)
            print(f"round {r + 1} {name}: {got}", flush=True)
    medians = {name: {key: round(statistics.median(x[key] for x in rs), 4) for key in rs[0]}
               for name, rs in rounds.items()}
    (with_it, without) = medians.values()
    ratios = {key: round(without[key] / with_it[key], 2) for key in with_it if key.endswith("_s")}
    print(f"medians: {medians}; without / with: {ratios}")
    path = record(args.name, {"args": vars(args), "rounds": rounds, "medians": medians,
                              "ratio_without_over_with": ratios})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
