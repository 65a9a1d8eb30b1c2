"""The stored responses: a run killed mid-write resumes without losing or regenerating what was stored."""

import logging

import pytest

from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.train.prompts import Prompt
from dflash_trt.train.responses import generate_responses, read_records
from tests.conftest import make_target

PROMPTS = [Prompt(f"question {i}: what is {w}?", "test") for i, w in enumerate(["red", "blue", "tea", "rain", "snow"])]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    t = make_target(tmp_path_factory.mktemp("target") / "t")
    return LLMEngine.from_dirs(t, None, EngineConfig(max_batch_size=2, speculative=False))


def test_records_appended_after_a_torn_line_are_kept(engine, tmp_path):
    path = tmp_path / "responses.jsonl"
    whole = generate_responses(engine, PROMPTS[:3], path, max_new_tokens=6, sampled_variants=0, batch_size=2)
    path.write_bytes(path.read_bytes()[:-25])  # killed mid-write: the last record torn
    torn = whole[-1]["id"]  # records are stored in the order generated (shortest prompts first)
    assert sorted(r["id"] for r in read_records(path)) == sorted(r["id"] for r in whole[:-1])
    records = generate_responses(engine, PROMPTS, path, max_new_tokens=6, sampled_variants=0, batch_size=2)
    # Appended after the torn line, the regenerated record would have been glued to it, and lost with every later one.
    assert sorted(r["id"] for r in records) == [f"{i}:greedy" for i in range(5)]
    assert {r["id"]: r for r in records}[torn] == whole[-1]
    assert generate_responses(engine, PROMPTS, path, max_new_tokens=6, sampled_variants=0) == records  # none redone


def test_a_last_line_whole_but_for_its_newline_is_kept(engine, tmp_path):
    path = tmp_path / "responses.jsonl"
    generate_responses(engine, PROMPTS[:2], path, max_new_tokens=6, sampled_variants=0)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    records = generate_responses(engine, PROMPTS[:3], path, max_new_tokens=6, sampled_variants=0)
    assert sorted(r["id"] for r in records) == ["0:greedy", "1:greedy", "2:greedy"]


WRONG_TYPES = ['{"id": "0:greedy", "source": "s", "split": "train", "mode": "greedy", "prompt_ids": [1], '
               f'"response_ids": {ids}}}' for ids in ('"hello"', "[1, null]", "[1, 2.5]", "[true]")]


@pytest.mark.parametrize("damage", ['{"id": "0:gre', '{"id": "0:greedy"}', "[1, 2]", *WRONG_TYPES])
def test_a_damaged_line_before_the_last_is_refused_naming_it(engine, tmp_path, damage):
    path = tmp_path / "responses.jsonl"
    generate_responses(engine, PROMPTS[:3], path, max_new_tokens=6, sampled_variants=0)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], damage, *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=f"{path} line 2 is not a response record .*: delete that line"):
        generate_responses(engine, PROMPTS[:3], path, max_new_tokens=6, sampled_variants=0)
    assert path.read_text().splitlines() == [lines[0], damage, *lines[2:]]  # nothing rewritten


def test_a_last_line_that_is_not_utf8_is_torn_and_generated_again(engine, tmp_path):
    # read and append alike: kept by one and cut by the other, the record was dropped from disk without a word
    path = tmp_path / "responses.jsonl"
    generate_responses(engine, PROMPTS[:2], path, max_new_tokens=6, sampled_variants=0)
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join([lines[0], lines[1].replace(b'"greedy"', b'"gr\xe9edy"', 1)]) + b"\n")
    records = generate_responses(engine, PROMPTS[:2], path, max_new_tokens=6, sampled_variants=0)
    assert sorted(r["id"] for r in records) == ["0:greedy", "1:greedy"]
    assert path.read_bytes().splitlines() == lines


def test_records_of_prompts_or_samples_a_run_does_not_ask_for_are_left_out_with_a_warning(engine, tmp_path, caplog):
    path = tmp_path / "responses.jsonl"
    generate_responses(engine, PROMPTS[:3], path, max_new_tokens=6, sampled_variants=1)
    with caplog.at_level(logging.WARNING, logger="dflash_trt"):
        records = generate_responses(engine, PROMPTS[:2], path, max_new_tokens=6, sampled_variants=0)
    assert sorted(r["id"] for r in records) == ["0:greedy", "1:greedy"]
    assert any("4 stored records answer prompts or samples this run does not ask for" in r.getMessage()
               for r in caplog.records)
    assert len(path.read_text().splitlines()) == 6  # kept on disk for a run that asks for them again


def test_a_finished_data_file_is_only_read(engine, tmp_path, monkeypatch):
    # a finished --data may be read-only (a shared or mounted dataset): nothing may be opened to write there
    import dflash_trt.train.responses as responses

    path = tmp_path / "responses.jsonl"
    first = generate_responses(engine, PROMPTS[:2], path, max_new_tokens=6, sampled_variants=0)
    monkeypatch.setattr(responses, "_drop_torn_tail", lambda p: pytest.fail(f"{p} opened to write"))
    assert generate_responses(engine, PROMPTS[:2], path, max_new_tokens=6, sampled_variants=0) == first


def test_a_prompt_too_long_to_answer_is_refused_before_any_is_answered(engine, tmp_path):
    # answered shortest first, it failed the run after every other prompt, naming none
    path = tmp_path / "responses.jsonl"
    long = Prompt("word " * engine.max_model_len, "my-file")
    with pytest.raises(ValueError, match=r"1 prompt\(s\) leave no room .*: prompt 3 \(my-file, \d+ "
                                         r"(tokens|characters)\).*"
                                         r"raise --max-seq-len"):
        generate_responses(engine, [*PROMPTS[:2], long], path, max_new_tokens=6, sampled_variants=0)
    assert read_records(path) == []
    longer = Prompt("word " * 20 * engine.max_model_len, "big-file")  # more characters than the limit's tokens hold
    with pytest.raises(ValueError, match=r"2 prompt\(s\) leave no room .*: prompt 3 \(my-file, \d+ "
                                         r"(tokens|characters)\), prompt 4 \(big-file, \d+ characters\)"):
        generate_responses(engine, [*PROMPTS[:2], long, longer], path, max_new_tokens=6, sampled_variants=0)


def test_prompts_answered_before_need_no_room_now(engine, tmp_path, monkeypatch):
    # a run resumed with a smaller --max-seq-len refused prompts it had nothing left to answer for
    path = tmp_path / "responses.jsonl"
    first = generate_responses(engine, PROMPTS[:2], path, max_new_tokens=6, sampled_variants=0)
    monkeypatch.setattr(engine, "max_model_len", 3)  # shorter than every prompt
    assert generate_responses(engine, PROMPTS[:2], path, max_new_tokens=6, sampled_variants=0) == first
    with pytest.raises(ValueError, match=r"1 prompt\(s\) .*: prompt 3 \(test, "):
        generate_responses(engine, PROMPTS[:3], path, max_new_tokens=6, sampled_variants=0)


def test_a_prompt_answered_before_and_now_too_long_to_tokenize_is_still_checked_against_its_record(engine, tmp_path):
    """Records are matched to prompts by position: one that answers another prompt is refused. A prompt too long for
    this run's limit even to tokenize (answered by a run with a longer one) skipped that check, and a stranger's
    record was kept for training."""
    import json
    import sys

    from dflash_trt.engine.prompt_encoder import PromptEncoder

    text = "word " * 20 * engine.max_model_len
    ids = PromptEncoder(engine.tokenizer, sys.maxsize).encode(text, chat=True)  # (the oracle: no limit to refuse)
    path = tmp_path / "responses.jsonl"
    for prompt_ids in ([7, 7, 7], ids):
        record = {"id": "0:greedy", "source": "big", "split": "train", "mode": "greedy", "prompt_ids": prompt_ids,
                  "response_ids": [5]}
        path.write_text(json.dumps(record) + "\n")
        if prompt_ids != ids:
            with pytest.raises(ValueError, match="records 0:greedy answer other prompts"):
                generate_responses(engine, [Prompt(text, "big")], path, max_new_tokens=6, sampled_variants=0)
        else:
            kept = generate_responses(engine, [Prompt(text, "big")], path, max_new_tokens=6, sampled_variants=0)
            assert [r["prompt_ids"] for r in kept] == [ids]
