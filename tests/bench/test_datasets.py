"""Benchmark prompts: real text, categorized, reproducible, with clear errors."""

import json

import pytest

from dflash_trt.bench.datasets import CATEGORIES, load_dataset, read_jsonl, shared_prefix
from dflash_trt.train.prompts import all_prompts


def test_builtin_categories_are_the_six_documented_ones_with_eight_prompts_each():
    prompts = load_dataset("cpu-small")
    counts = {c: sum(p.category == c for p in prompts) for c in CATEGORIES}
    assert counts == {c: 8 for c in CATEGORIES}
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.max_tokens == 64 for p in prompts)


def test_heldout_prompts_come_from_the_training_heldout_split_only():
    held = load_dataset("heldout", osl=16)
    train_texts = {p.text for p in all_prompts() if p.split == "train"}
    assert held and all(p.category == "heldout" and p.max_tokens == 16 for p in held)
    assert not {p.text for p in held} & train_texts


def test_category_filter_and_limit():
    prompts = load_dataset("cpu-small", categories=["code", "math"], limit_per_category=3)
    assert [p.category for p in prompts] == ["code"] * 3 + ["math"] * 3
    with pytest.raises(ValueError, match="no categories \\['poetry'\\]"):
        load_dataset("cpu-small", categories=["poetry"])


def test_long_context_presets_hit_the_input_length_in_tokens(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = load_dataset("gpu-1k1k", tokenizer=tok)
    assert {p.category for p in prompts} == {"code", "writing", "qa", "summarization"}
    lengths = [len(tok(p.text)["input_ids"]) for p in prompts]
    assert all(900 <= n <= 1100 for n in lengths), lengths
    assert all(p.max_tokens == 1024 for p in prompts)
    assert load_dataset("gpu-1k1k", tokenizer=tok) == prompts  # reproducible


def test_the_shared_prefix_is_real_text_of_the_length_asked_for_every_time(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prefix = shared_prefix(1000, tok)
    assert 990 <= len(tok(prefix, add_special_tokens=False)["input_ids"]) <= 1010  # decoded, then encoded again
    assert prefix == shared_prefix(1000, tok) and shared_prefix(1200, tok).startswith(prefix[:-20])
    assert len(shared_prefix(100)) == 400 and " the " in prefix  # about 4 characters a token without a tokenizer


def test_jsonl_files_speed_bench_layout_and_errors_name_the_line(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text(json.dumps({"turns": ["Write a sort in C."], "category": "coding"}) + "\n"
                    + json.dumps({"prompt": "Hi", "max_tokens": 5}) + "\n"
                    + json.dumps({"prompt": "Yo", "category": None}) + "\n")
    a, b, c = load_dataset(str(good), osl=None)
    assert (a.category, a.text, a.max_tokens) == ("coding", "Write a sort in C.", 128)
    assert (b.category, b.max_tokens) == ("default", 5)
    assert (c.category, c.id) == ("default", "default/3")  # null is no category, as a null id is no id
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: needs a non-empty"):
        read_jsonl(bad, 8)
    with pytest.raises(ValueError, match="neither a built-in"):
        load_dataset("no-such-dataset")
    for line, message in (('["hi"]', "not a JSON object"), ('{"prompt": "hi", "max_tokens": null}', "'max_tokens'"),
                          ('{"prompt": "hi", "max_tokens": 0}', "'max_tokens' must be a whole number >= 1")):
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:1: {message}"):
            read_jsonl(bad, 8)
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"prompt": "a", "id": null}\n{"prompt": "b", "id": null}\n')
    assert [p.id for p in read_jsonl(ids, 8)] == ["default/1", "default/2"]


def test_long_context_presets_give_a_sweep_a_prompt_per_request():
    # A server's prefix cache would answer a repeated long prompt in part: a sweep asks for one per request.
    prompts = load_dataset("gpu-8k1k", min_prompts=1000)
    assert len(prompts) >= 1000 and len({p.text for p in prompts}) == len(prompts)
    code = load_dataset("gpu-1k1k", categories=["code"], min_prompts=300)
    assert len(code) >= 300 and {p.category for p in code} == {"code"}
    assert load_dataset("gpu-1k1k", min_prompts=1000) == load_dataset("gpu-1k1k", min_prompts=1000)  # reproducible


def test_isl_is_refused_for_files_whose_prompts_are_used_as_written(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="--isl applies to the built-in datasets"):
        load_dataset(str(f), isl=1024)


def test_a_dataset_file_that_is_a_directory_or_not_utf8_is_named(tmp_path):
    folder = tmp_path / "d.jsonl"
    folder.mkdir()
    with pytest.raises(ValueError, match=f"dataset file {folder} is not a file"):
        load_dataset(str(folder))
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"prompt": "hi"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=f"{binary}:2: not UTF-8"):
        load_dataset(str(binary))


def test_a_repeated_id_is_refused_naming_both_lines(tmp_path):
    # a sweep counts the prompts it sends again (repeated_prompts) by id: two prompts under one id would be one
    f = tmp_path / "dup.jsonl"
    f.write_text('{"prompt": "a", "id": "q1"}\n\n{"prompt": "b", "id": "q2"}\n{"prompt": "c", "id": "q1"}\n')
    with pytest.raises(ValueError, match=r"dup.jsonl:4: id 'q1' repeats that of line 1"):
        load_dataset(str(f))
    # a number and its digits are one id to a sweep, as is a given id and the one a line without one is named
    f.write_text('{"prompt": "a", "id": 7}\n{"prompt": "b", "id": "7"}\n')
    with pytest.raises(ValueError, match=r"dup.jsonl:2: id '7' repeats that of line 1"):
        read_jsonl(f, 8)
    f.write_text('{"prompt": "a"}\n{"prompt": "b", "id": "default/1"}\n')
    with pytest.raises(ValueError, match=r"dup.jsonl:2: id 'default/1' repeats that of line 1"):
        read_jsonl(f, 8)
