"""Structured output at one stream: plain decoding under a grammar against DFlash under the same grammar, side by side
in one run (decode tokens/s: each answer's tokens after its first over its decode time), on the CPU default engine
(SmolLM2-135M-Instruct, bf16, the shipped drafter, its default tree and lookups).
Tasks are chat prompts asking for what the grammar holds them to (JSON by a schema, a date by a regex, one of some
labels); each answer is checked identical to the plain one, and the grammar's own time (its masks, engine/grammar.py)
is counted. The same prompts unconstrained give the drafter's tau without a grammar, for comparison.

    .venv/bin/python benchmarks/structured_output_speed.py [--engine engines/smollm2-135m-cpu] [--threads 2]
        [--rounds 2] [--max-tokens 96] [--chain] [--name structured_output_speed]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Arm, one_stream, record  # noqa: E402

from dflash_trt import SamplingParams, StructuredOutput, open_engine  # noqa: E402
from dflash_trt.engine.grammar import Grammar  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "product": {"type": "string"}, "quantity": {"type": "integer"}}, "required": ["product", "quantity"]}},
    "total": {"type": "number"}}, "required": ["items", "total"]}
TASKS = [
    ("json", "Extract the person as JSON with name, age and city: Maria Lopez is 34 and lives in Seville.", PERSON),
    ("json", "Give a JSON record (name, age, city) for a fictional detective from London.", PERSON),
    ("json", "As JSON: an order of 2 apples and 3 pears, with the total price if each costs 0.5.", ORDER),
    ("json", "Return JSON describing a shopping order: one laptop and two mice, and its total.", ORDER),
    ("regex", "When did the Berlin Wall fall? Answer with the date as YYYY-MM-DD.", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("regex", "What is the date of the first Moon landing? Answer as YYYY-MM-DD.", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("choice", "Is this review positive or negative? 'The food was cold and the staff rude.'",
     ["positive", "negative"]),
    ("choice", "Classify the topic of: 'The central bank raised interest rates again.'",
     ["sports", "finance", "science", "politics"]),
]


def _spec(kind: str, what) -> StructuredOutput:
    return StructuredOutput(**{kind: what})


def _timed_grammar() -> list[float]:
    """Wrap Grammar.blocked to add up the seconds its masks take."""
    spent = [0.0]
    real = Grammar.blocked

    def blocked(self, extras, device):
        start = time.perf_counter()
        try:
            return real(self, extras, device)
        finally:
            spent[0] += time.perf_counter() - start

    Grammar.blocked = blocked
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m-cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--chain", action="store_true", help="draft chains (no tree, no lookups), as grammar rows draft")
    ap.add_argument("--name", default="structured_output_speed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    chain = dict(draft_tree={}, draft_tree_without_amx={}, lookup_nodes=0) if args.chain else {}
    spec_engine = open_engine(args.engine, max_batch_size=1, **chain)
    plain_engine = open_engine(args.engine, max_batch_size=1, speculative=False)
    prompts = [spec_engine.encode(text, chat=True) for _, text, _ in TASKS]
    guided = [SamplingParams(max_new_tokens=args.max_tokens, structured=_spec(kind, what)) for kind, _, what in TASKS]
    free = [SamplingParams(max_new_tokens=args.max_tokens) for _ in TASKS]
    spent = _timed_grammar()
    one_stream(spec_engine, prompts[:2], guided[:2])  # warm-up: the grammar's token table, kernels, shapes
    one_stream(plain_engine, prompts[:2], guided[:2])
    arms: dict[str, Arm] = {}
    grammar_s: dict[str, float] = {}
    for r in range(args.rounds):
        order = [("plain", plain_engine, guided), ("dflash", spec_engine, guided),
                 ("plain_free", plain_engine, free), ("dflash_free", spec_engine, free)]
        for name, engine, params in order if r % 2 == 0 else order[::-1]:
            spent[0] = 0.0
            outs, wall, tokens = one_stream(engine, prompts, params)
            arms.setdefault(name, Arm()).add(outs, wall, tokens)
            grammar_s[name] = grammar_s.get(name, 0.0) + (spent[0] if params is guided else 0.0)
            print(f"round {r} {name}: {tokens / wall:.1f} tok/s decoding", flush=True)
    summary = {}
    for name, arm in arms.items():
        summary[name] = {"tok_per_s": arm.tok_per_s, "tau": arm.tau,
                         "grammar_ms_per_token": round(1e3 * grammar_s[name] / arm.tokens, 3)}
    for spec, base in (("dflash", "plain"), ("dflash_free", "plain_free")):
        summary[spec]["speedup"] = round(summary[spec]["tok_per_s"] / summary[base]["tok_per_s"], 3)
        summary[spec]["identical"] = sum(a == b for a, b in zip(arms[spec].outputs, arms[base].outputs))
        summary[spec]["of"] = len(TASKS)
    texts = [spec_engine.tokenizer.decode(ids, skip_special_tokens=True) for ids in arms["dflash"].outputs]
    for name, s in summary.items():
        print(name, s)
    path = record(args.name, {"config": vars(args), "summary": summary, "answers": texts})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
