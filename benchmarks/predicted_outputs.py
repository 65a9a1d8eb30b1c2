"""OpenAI's predicted outputs at one stream: plain decoding against DFlash without a prediction, with the file the
answer rewrites as its prediction, and with the answer itself as its prediction (a perfect one: the ceiling), side by
side in one run (decode tokens/s: each answer's tokens after its first over its decode time), on the CPU default engine
(SmolLM2-135M-Instruct, bf16, the shipped drafter, its default tree and lookups). Tasks ask for a short program back
with a small change; each answer is checked identical to the plain one, and the prediction's tokens the answer
repeated are counted (server/prediction.py).

    .venv/bin/python benchmarks/predicted_outputs.py [--engine engines/smollm2-135m-cpu] [--threads 2] [--rounds 2]
        [--max-tokens 160] [--name predicted_outputs]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Arm, one_stream, record  # noqa: E402

from dflash_trt import SamplingParams, open_engine  # noqa: E402
from dflash_trt.server.prediction import prediction_tokens  # noqa: E402

CODE = [
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
    "    return 2 * (width + height)\n",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count += 1\n        return self.count\n",
    "def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(message)\n    return message\n",
]
ASKS = ["Add a docstring to each function and return the whole code:", "Rename the variable total to acc and return "
        "the whole function:", "Add a reset method that sets count to 0 and return the whole class:",
        "Use an f-string in this function and return the whole function:"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m-cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--name", default="predicted_outputs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    spec_engine = open_engine(args.engine, max_batch_size=1)
    plain_engine = open_engine(args.engine, max_batch_size=1, speculative=False)
    tok = spec_engine.tokenizer
    prompts = [spec_engine.encode(f"{ask}\n\n```python\n{code}```", chat=True) for ask, code in zip(ASKS, CODE)]
    plain = [SamplingParams(max_new_tokens=args.max_tokens) for _ in CODE]
    answers = [o.token_ids for o in one_stream(plain_engine, prompts, plain)[0]]  # (and warm-up)
    one_stream(spec_engine, prompts[:2], plain[:2])
    files = [tok.encode(f"```python\n{code}```", add_special_tokens=False) for code in CODE]
    perfect = [tok.encode(tok.decode(a, skip_special_tokens=True), add_special_tokens=False) for a in answers]
    arms = {"plain": (plain_engine, plain), "dflash": (spec_engine, plain),
            "dflash_file": (spec_engine, [SamplingParams(max_new_tokens=args.max_tokens, prediction=f) for f in files]),
            "dflash_answer": (spec_engine, [SamplingParams(max_new_tokens=args.max_tokens, prediction=a)
                                            for a in perfect])}
    totals = {name: Arm() for name in arms}
    for r in range(args.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            engine, params = arms[name]
            outs, wall, tokens = one_stream(engine, prompts, params)
            totals[name].add(outs, wall, tokens)
            print(f"round {r} {name}: {tokens / wall:.1f} tok/s decoding", flush=True)
    summary = {}
    for name, arm in totals.items():
        summary[name] = {"tok_per_s": arm.tok_per_s, "tau": arm.tau,
                         "identical": sum(a == b for a, b in zip(arm.outputs, totals["plain"].outputs)),
                         "of": len(CODE)}
        summary[name]["speedup"] = round(summary[name]["tok_per_s"] / summary["plain"]["tok_per_s"], 3)
    for name, predictions in (("dflash_file", files), ("dflash_answer", perfect)):
        counts = [prediction_tokens(p, o) for p, o in zip(predictions, totals[name].outputs)]
        summary[name]["accepted_prediction_tokens"] = sum(a for a, _ in counts)
        summary[name]["rejected_prediction_tokens"] = sum(r for _, r in counts)
    for name, s in summary.items():
        print(name, s)
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in totals["plain"].outputs]
    path = record(args.name, {"config": vars(args), "summary": summary, "answers": texts})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
