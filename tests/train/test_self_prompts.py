"""Prompts the target writes itself from its chat template's user-turn prefix (Magpie)."""

from dataclasses import dataclass

import pytest

from dflash_trt.train.prompts import Prompt
from dflash_trt.train.self_prompts import (
    PERSONAS,
    SUMMARY_SOURCE,
    Persona,
    acceptable,
    cached_self_prompts,
    generate_self_prompts,
    passage_of,
    qa_answers,
    read_prompts,
    summary_requests,
    user_turn_prefix,
    write_prompts,
)


def test_the_prefix_is_the_template_up_to_the_users_words(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    for system in (None, "You are a patient math tutor."):
        prefix = user_turn_prefix(tok, system)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "What is 2 + 2?"}]
        full = tok.apply_chat_template(messages, tokenize=False)
        text = tok.decode(prefix)
        assert full.startswith(text) and full[len(text):].startswith("What is 2 + 2?")
        assert text.endswith("<|im_start|>user\n")
        assert (system or "SmolLM") in text  # the template's default system message when none is given


@pytest.mark.parametrize("text, ok", [
    ("How do I reverse a list in Python?", True),
    ("Write a function that sums the digits of an integer.", True),
    ("I'm planning a trip to Rome. Any tips", True),
    ("The ancient earth loomed before me, a dark and stormy sky.", False),  # a story, not a request
    ("Why?", False),  # too short
    ("Que es esto? " + "é" * 20, False),  # mostly outside printable ASCII
    ("What " * 300 + "?", False),  # too long
])
def test_only_finished_readable_requests_are_kept(text, ok):
    assert acceptable(text) is ok


@dataclass
class _Out:
    text: str
    finish_reason: str


class _ScriptedEngine:
    """Answers generate() from a script, recording the prompts and seeds it was asked for."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, list(script), []

    def generate(self, prompts, params):
        self.calls.append((prompts, [p.seed for p in params]))
        return [self.script.pop(0) if self.script else _Out("", "length") for _ in prompts]


def test_generation_keeps_distinct_finished_requests_and_stops_at_the_count(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    script = [_Out("How do I sort a dict by value?", "stop"),
              _Out("How do I sort a dict by value?", "stop"),  # duplicate
              _Out("What is the capital of France?", "stop"),  # a benchmark prompt: excluded
              _Out("Can you explain recursion", "length"),  # cut off by the token limit
              _Out("Explain what a closure is in JavaScript.", "stop"),
              _Out("Explain list comprehensions.", "stop")]  # past the count: never read
    engine = _ScriptedEngine(tok, script)
    out = generate_self_prompts(engine, 2, personas=(Persona("code", "You write code."),),
                                exclude={"What is the capital of France?"}, chunk=5)
    assert [p.text for p in out] == ["How do I sort a dict by value?", "Explain what a closure is in JavaScript."]
    assert {p.source for p in out} == {"self/code"}
    (prompts, seeds), *_ = engine.calls
    assert prompts[0] == user_turn_prefix(tok, "You write code.") and len(set(seeds)) == len(seeds)


def test_generation_gives_up_after_four_tries_per_wanted_prompt(smollm2_dir):
    from transformers import AutoTokenizer

    engine = _ScriptedEngine(AutoTokenizer.from_pretrained(smollm2_dir), [])
    assert generate_self_prompts(engine, 3, personas=PERSONAS[:1], chunk=5) == []
    assert sum(len(p) for p, _ in engine.calls) == 12


def test_stored_prompts_are_reused_not_resampled(smollm2_dir, tmp_path):
    # Records name prompts by position: a rerun must see the same texts, even on other numerics.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    script = [_Out(f"How do I use feature {i} of the library?", "stop") for i in range(4 * len(PERSONAS))]
    path = tmp_path / "data" / "self_prompts.jsonl"
    first = cached_self_prompts(_ScriptedEngine(tok, script), path, 1)
    assert [p.source for p in first] == ["self/chat", "self/code", "self/math", "self/qa", "self/writing"]
    again = _ScriptedEngine(tok, [_Out("Something else entirely?", "stop")] * len(PERSONAS))
    assert cached_self_prompts(again, path, 1) == first and again.calls == []


@pytest.mark.parametrize("damage", ['{"text": "How do', '{"prompt": "How do I?"}'])
def test_a_damaged_stored_prompt_is_refused_naming_its_line(tmp_path, damage):
    path = tmp_path / "self_prompts.jsonl"
    write_prompts(path, [Prompt("How do I sort a list?", "self/code"), Prompt("Why is the sky blue?", "self/qa")])
    path.write_text(path.read_text().splitlines()[0] + "\n" + damage + "\n")
    with pytest.raises(ValueError, match=f"{path} line 2 is not a prompt .*: restore the file, or pass another --data"):
        read_prompts(path)


def test_the_real_target_writes_acceptable_requests(smollm2_dir):
    import torch

    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine

    torch.manual_seed(0)
    engine = LLMEngine.from_dirs(smollm2_dir, None, EngineConfig(max_batch_size=8, speculative=False,
                                                                 dtype="bfloat16", max_model_len=256))
    out = generate_self_prompts(engine, 2, personas=PERSONAS[:1], chunk=8, max_new_tokens=64)
    # The target's own samples pass the filter often (about 2 in 3 on this target): 2 of at most 8 is a loose bound.
    assert len(out) == 2 and all(acceptable(p.text) for p in out)


ANSWER = ("The sky looks blue because air scatters the short wavelengths of sunlight more than the long ones. "
          "This is called Rayleigh scattering.\n\nAt sunset the light crosses much more air, so the blue is "
          "scattered away and the sky turns red and orange. Clouds look white because their droplets scatter all "
          "wavelengths alike.")


def test_a_passage_is_the_answers_leading_whole_sentences_on_one_line():
    assert passage_of(ANSWER, max_chars=200) == (
        "The sky looks blue because air scatters the short wavelengths of sunlight more than the long ones. "
        "This is called Rayleigh scattering.")
    assert passage_of(ANSWER) == " ".join(ANSWER.split())  # all of it fits in 500 characters


@pytest.mark.parametrize("answer", [
    "Rayleigh scattering makes the sky blue, since short wavelengths scatter most of all in the air above us.",  # one
    "Yes. It is.",  # too short
    "Use this code. It prints the sum of two numbers for you:\n```python\nprint(1 + 2)\n```\nThat is all there is.",
    "The first step is the most important one of all the steps there are to take here. And the second one " + "x" * 600,
    "Here are the three books I would recommend to you: 1. The Chocolate Diet, a classic. 2. Sweet Health, a newer one.",
    "I'm so glad you're happy with your knitting. I'm so glad you're happy with your knitting. I'm so glad you're happy.",
])
def test_no_passage_from_a_short_answer_code_a_list_a_repetition_loop_or_an_unfinished_sentence(answer):
    assert passage_of(answer) is None


def test_summary_requests_quote_the_passage_are_stable_and_distinct():
    other = ("Bees pollinate many of the crops that people eat every day. When bees decline, farmers harvest less fruit and "
             "fewer vegetables.")
    out = summary_requests([ANSWER, "No.", ANSWER, other])
    assert [p.source for p in out] == [SUMMARY_SOURCE] * 2  # the short answer gives none, the repeat is dropped
    assert out[0].text.endswith(": " + " ".join(ANSWER.split())) and out[1].text.endswith(": " + other)
    assert all(p.text.startswith(("Summarize", "Give a short summary")) for p in out)
    assert summary_requests([ANSWER, other]) == out  # the template is a function of the passage
    assert summary_requests([ANSWER, other], exclude={out[1].text}) == out[:1]


def test_qa_answers_are_the_greedy_answers_to_the_qa_requests_in_prompt_order(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    records = [{"id": "11:greedy", "source": "self/qa", "mode": "greedy", "response_ids": enc("Second answer.")},
               {"id": "9:greedy", "source": "self/qa", "mode": "greedy", "response_ids": enc("First answer.")},
               {"id": "9:sample0", "source": "self/qa", "mode": "sample0", "response_ids": enc("A sample.")},
               {"id": "10:greedy", "source": "self/chat", "mode": "greedy", "response_ids": enc("A chat answer.")}]
    assert qa_answers(records, tok) == ["First answer.", "Second answer."]


def test_stored_prompts_written_for_another_count_are_reused_with_a_warning_naming_both(smollm2_dir, tmp_path, caplog):
    import logging

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    script = [_Out(f"How do I use feature {i} of the library?", "stop") for i in range(4 * len(PERSONAS))]
    path = tmp_path / "self_prompts.jsonl"
    first = cached_self_prompts(_ScriptedEngine(tok, script), path, 1)
    with caplog.at_level(logging.INFO, logger="dflash_trt"):
        assert cached_self_prompts(_ScriptedEngine(tok, []), path, 1) == first
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert cached_self_prompts(_ScriptedEngine(tok, []), path, 3) == first
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "written for 1 per persona, not the 3 asked now" in warned[0]


def test_a_stored_prompt_that_is_not_utf8_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "self_prompts.jsonl"
    write_prompts(path, [Prompt("How do I sort a list?", "self/code"), Prompt("Why is the sky blue?", "self/qa")])
    path.write_bytes(path.read_bytes().replace(b"sky", b"sk\xe9"))
    with pytest.raises(ValueError, match=f"{path} line 2 is not a prompt"):
        read_prompts(path)


def test_an_interrupted_run_keeps_its_finished_personas_and_samples_only_the_rest(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)

    class Interrupted(_ScriptedEngine):
        def generate(self, prompts, params):
            if self.calls:  # Ctrl-C during the second persona
                raise KeyboardInterrupt
            return super().generate(prompts, params)

    path = tmp_path / "self_prompts.jsonl"
    with pytest.raises(KeyboardInterrupt):
        cached_self_prompts(Interrupted(tok, [_Out("How do I greet a friend?", "stop")] * 4), path, 1, chunk=4)
    assert not path.exists()
    script = [_Out(f"How do I use feature {i} of the library?", "stop") for i in range(4 * len(PERSONAS))]
    again = _ScriptedEngine(tok, script)
    prompts = cached_self_prompts(again, path, 1, chunk=4)
    assert prompts[0] == Prompt("How do I greet a friend?", f"self/{PERSONAS[0].name}")
    assert [p.source for p in prompts] == [f"self/{p.name}" for p in PERSONAS]
    assert len(again.calls) == len(PERSONAS) - 1  # the finished persona is not sampled again
    assert read_prompts(path) == prompts and not (tmp_path / "self_prompts.partial.jsonl").exists()


def test_an_interrupted_run_of_another_count_is_not_resumed(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)

    class InterruptedAfter(_ScriptedEngine):
        def __init__(self, calls, script):
            super().__init__(tok, script)
            self.allowed = calls

        def generate(self, prompts, params):
            if len(self.calls) == self.allowed:
                raise KeyboardInterrupt
            return super().generate(prompts, params)

    path = tmp_path / "self_prompts.jsonl"
    two = [_Out(f"How do I greet friend {i}?", "stop") for i in range(8)]
    with pytest.raises(KeyboardInterrupt):  # 2 a persona: the first persona kept
        cached_self_prompts(InterruptedAfter(1, two), path, 2, chunk=8)
    with pytest.raises(KeyboardInterrupt):  # 1 a persona, stopped before any finished
        cached_self_prompts(InterruptedAfter(0, []), path, 1, chunk=4)
    script = [_Out(f"How do I use feature {i} of the library?", "stop") for i in range(4 * len(PERSONAS))]
    prompts = cached_self_prompts(_ScriptedEngine(tok, script), path, 1, chunk=4)
    assert [p.source for p in prompts] == [f"self/{p.name}" for p in PERSONAS]  # one each, none from the 2-run
