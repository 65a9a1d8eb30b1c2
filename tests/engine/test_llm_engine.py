"""LLMEngine as a Python user drives it: from several threads at once, through a failure or a Ctrl-C midway, and
streamed; every answer transformers' own greedy one."""

import threading

import pytest

from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.sampling_params import SamplingParams
from tests.engine.test_lossless import hf_greedy

PROMPTS = ["the quick brown fox", "hello there", "x y z", "abcabc abc"]
NEW = 24


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"],
                               EngineConfig(max_batch_size=4, max_draft_len=3, max_model_len=256))


def want(tiny_dirs, llm, prompt: str) -> list[int]:
    return hf_greedy(tiny_dirs["qwen3"], llm.encode(prompt), NEW)


def params() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, ignore_eos=True)


def test_threads_sharing_an_engine_each_get_their_own_answer(tiny_dirs, llm):
    got: dict[str, list[int]] = {}

    def ask(prompt: str) -> None:
        for _ in range(3):  # calls that overlap in every way: one thread's steps run the others' requests too
            got[prompt] = llm.generate(prompt, params())[0].token_ids

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {p: want(tiny_dirs, llm, p) for p in PROMPTS}
    assert not llm.has_unfinished()


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_a_call_that_stops_midway_leaves_nothing_running_for_the_next(tiny_dirs, llm, monkeypatch, failure):
    """Its requests are aborted: the next call runs its own alone, not the stopped one's rows beside it."""
    rows: list[int] = []
    step = LLMEngine.step

    def stopped(self):
        result = step(self)
        rows.append(result.batch_size)
        if len(rows) == 3:
            raise failure("stopped midway")
        return result

    monkeypatch.setattr(LLMEngine, "step", stopped)
    with pytest.raises(failure):
        llm.generate(PROMPTS[:2], params())
    rows[:] = [0] * 3  # counted on past the third step: no more failures
    out = llm.generate(PROMPTS[2], params())[0]
    assert out.token_ids == want(tiny_dirs, llm, PROMPTS[2])
    assert max(rows[3:]) == 1 and not llm.has_unfinished()


def test_a_stream_gives_the_answer_as_steps_make_it_and_aborts_where_left(tiny_dirs, llm):
    chunks = list(llm.stream(PROMPTS[0], params()))
    assert len(chunks) > 2 and all(c.output is None for c in chunks[:-1])
    out = chunks[-1].output
    assert out.token_ids == want(tiny_dirs, llm, PROMPTS[0]) and "".join(c.text for c in chunks) == out.text
    assert [c.num_tokens for c in chunks] == sorted(c.num_tokens for c in chunks) and chunks[-1].num_tokens == NEW
    for chunk in llm.stream(PROMPTS[1], params()):
        break  # a reader that has seen enough
    assert llm.generate(PROMPTS[3], params())[0].token_ids == want(tiny_dirs, llm, PROMPTS[3])
    assert not llm.has_unfinished()


def test_a_stream_finished_by_another_calls_steps_still_ends_with_its_text_and_output(tiny_dirs, llm):
    """Every step runs every request: one that another call's step finished between two chunks ended the stream
    without its last text or its output."""
    stream = llm.stream(PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    first = next(stream)
    other = llm.generate(PROMPTS[1], params())[0]  # steps past the stream's 4 tokens
    chunks = [first, *stream]
    assert other.token_ids == want(tiny_dirs, llm, PROMPTS[1])
    out = chunks[-1].output
    assert out is not None and out.token_ids == want(tiny_dirs, llm, PROMPTS[0])[:4]
    assert "".join(c.text for c in chunks) == out.text


def test_generate_returns_once_its_own_requests_finish(tiny_dirs, llm):
    """It waited for every request in the engine: beside an open stream of 200 tokens, a 4-token answer took the
    stream's whole time (and ran it to its end)."""
    stream = llm.stream(PROMPTS[2], SamplingParams(max_new_tokens=200, ignore_eos=True))
    first = next(stream)
    short = llm.generate(PROMPTS[3], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert short.token_ids == want(tiny_dirs, llm, PROMPTS[3])[:4]
    assert llm.has_unfinished()  # the stream's request runs on, in its own call
    chunks = [first, *stream]
    assert chunks[-1].output.num_tokens == 200 and "".join(c.text for c in chunks) == chunks[-1].output.text
    assert not llm.has_unfinished()


@pytest.mark.parametrize("prompt", [5, [1, 2], None])
def test_encode_takes_text_only(llm, prompt):
    with pytest.raises(TypeError, match=f"encode takes text, got {type(prompt).__name__}"):
        llm.encode(prompt)


@pytest.mark.parametrize("ids", [[9.7, 11.2], [True, False], "hello", ["a"]])
def test_add_request_takes_token_ids_only(llm, ids):
    """Floats were cut to ints and bools read as tokens 1 and 0 (an answer to another prompt); text failed comparing
    a string with an int."""
    with pytest.raises(TypeError, match="prompt_ids must be a list of token ids"):
        llm.add_request(ids, params())
    assert not llm.has_unfinished()


@pytest.mark.parametrize("field, value, message", [("max_new_tokens", 0, "max_new_tokens"),
                                                    ("temperature", -1.0, "temperature"),
                                                    ("acceptance", "x", "acceptance")])
def test_sampling_params_changed_after_construction_are_checked_as_new_ones(llm, field, value, message):
    """Checks ran at construction only: max_new_tokens 0 still gave a token, a temperature of -1 sampled."""
    sp = params()
    setattr(sp, field, value)
    with pytest.raises(ValueError, match=message):
        llm.generate("x", sp)
    assert not llm.has_unfinished()


def test_a_stop_string_set_after_construction_is_one_string(tiny_dirs, llm):
    text = llm.generate(PROMPTS[0], params())[0].text
    sp = params()
    sp.stop = text[1] + "\u2603"  # not in the answer (taken as its characters, the first stopped it)
    assert llm.generate(PROMPTS[0], sp)[0].token_ids == want(tiny_dirs, llm, PROMPTS[0])


def test_parameters_that_are_no_sampling_params_are_refused_by_type(llm):
    with pytest.raises(TypeError, match="params must be a SamplingParams, got dict"):
        llm.generate("x", {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="2 prompts but 0 SamplingParams"):  # not the defaults for both
        llm.generate(["x", "y"], [])


@pytest.mark.parametrize("prompt, error, message", [
    (["a", "b"], ValueError, "stream takes one prompt, got 2"),
    (None, TypeError, "prompts must be a string, a list of token ids"),
    ([True, False], TypeError, "must be a string or a list of token ids"),  # a bool would read as token 0 or 1
    ([1.0, 2.0], TypeError, "must be a string or a list of token ids"),
    ([], ValueError, "empty prompt: at least one token is needed"),  # not "a batch of 0 prompts"
    ("", ValueError, "empty prompt: at least one token is needed"),
])
def test_a_streamed_prompt_is_checked_as_a_generated_one(llm, prompt, error, message):
    with pytest.raises(error, match=message):
        next(llm.stream(prompt, params()))
    assert not llm.has_unfinished()


@pytest.mark.parametrize("field, value, kind", [
    ("max_batch_size", "4", "an integer"), ("max_batch_size", 2.5, "an integer"), ("lookup_nodes", 1.5, "an integer"),
    ("max_model_len", None, "an integer"), ("speculative", "no", "True or False"),
])
def test_engine_settings_of_the_wrong_type_are_refused_naming_the_field(field, value, kind):
    with pytest.raises(ValueError, match=f"{field} must be {kind}, got {value!r}"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("overrides, message", [
    ({"max_draft_len": -1}, "max_draft_len must be >= 0, got -1"),  # it named a table K was applied to
    ({"draft_tree": 5}, "draft_tree must map batch sizes to nodes"),  # AttributeError: no .items()
    ({"draft_len_schedule": [1, 2]}, "draft_len_schedule must map batch sizes to K"),
    ({"draft_tree": {1: 2.5}}, "draft_tree must map batch sizes to nodes"),
])
def test_open_engine_names_the_override_at_fault(tiny_dirs, tmp_path_factory, overrides, message):
    from dflash_trt.engine_dir import open_engine
    from tests.test_build import write_config

    root = tmp_path_factory.getbasetemp() / "api_engine"
    if not (root / "e").is_dir():
        from dflash_trt.build import build_engine

        root.mkdir(exist_ok=True)
        build_engine(write_config(root, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"]), root / "e", progress=False)
    with pytest.raises(ValueError, match=message):
        open_engine(root / "e", **overrides)


@pytest.mark.parametrize("prompts, params_, message", [
    (["x", ""], None, r"prompts\[1\]: empty prompt"),
    (["x", [10**9]], None, r"prompts\[1\]: prompt token ids must be in"),
    ([[], "x"], None, r"prompts\[0\]: empty prompt"),
    (["x", "y"], [params(), SamplingParams(max_new_tokens=4, stop_token_ids=[10**9])],
     r"prompts\[1\] with params\[1\]: stop_token_ids token ids must be in"),
])
def test_a_bad_prompt_among_several_is_named_by_its_index_and_none_of_them_runs(llm, prompts, params_, message):
    with pytest.raises((ValueError, TypeError), match=message):
        llm.generate(prompts, params_ if params_ is not None else params())
    assert not llm.has_unfinished()


def test_a_lone_prompts_error_reads_as_before(llm):
    with pytest.raises(ValueError, match=r"^empty prompt"):
        llm.generate([""], params())


def _engine(tiny_dirs, **cfg) -> LLMEngine:
    config = EngineConfig(**{"max_batch_size": 4, "max_draft_len": 3, "max_model_len": 256, **cfg})
    return LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], config)


SHARED = "the system prompt says hello to all of you "  # chunks of 4 tokens that later prompts take over


def test_a_prompt_copy_a_failed_step_cut_short_leaves_its_request_holding_nothing(tiny_dirs, monkeypatch):
    """A request that takes over a running row's prompt chunks got them as its own when scheduled, and the copy ran
    later in the step: a step stopped before the copy left it (and the row it was aborted from) holding chunks that
    were never written, and the answers that took them over went wrong."""
    from dflash_trt.engine.model_runner import ModelRunner

    prompts = [SHARED + q for q in ("fox", "dog jumps", "cat")]
    copy_prompt = ModelRunner.copy_prompt

    def interrupted(*args):
        raise KeyboardInterrupt

    for bystander in (False, True):
        llm = _engine(tiny_dirs, prefill_chunk=4, max_prefill_tokens=8)  # (no freed row holds the chunks)
        holder = llm.stream(prompts[0], params())
        next(holder)  # running: its row holds the shared chunks
        other = llm.add_request(llm.encode(prompts[1]), params()) if bystander else None  # another caller's
        monkeypatch.setattr(ModelRunner, "copy_prompt", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts[2], params())
        monkeypatch.setattr(ModelRunner, "copy_prompt", copy_prompt)
        assert [*holder][-1].output.token_ids == want(tiny_dirs, llm, prompts[0])
        if other is not None:
            while not other.is_finished:
                llm.step()
            assert other.output_ids == want(tiny_dirs, llm, prompts[1])
        outs = llm.generate(prompts, params())
        assert [o.token_ids for o in outs] == [want(tiny_dirs, llm, p) for p in prompts]
        assert not llm.has_unfinished()


def test_a_request_a_failed_step_finished_is_released_and_decodes_no_further(tiny_dirs, llm, monkeypatch):
    """Its last token came from the step's first prompt chunk and a later chunk's forward raised: it stayed among the
    running requests and the next step, whoever's, decoded past its end (2 tokens for max_new_tokens=1)."""
    from dflash_trt.engine.model_runner import ModelRunner

    prefill = ModelRunner.prefill
    calls = []

    def second_fails(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return prefill(self, *args)

    one = llm.add_request(llm.encode(PROMPTS[0]), SamplingParams(max_new_tokens=1, ignore_eos=True))
    monkeypatch.setattr(ModelRunner, "prefill", second_fails)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[1], params())
    monkeypatch.setattr(ModelRunner, "prefill", prefill)
    assert one.is_finished and one not in llm.scheduler.running
    assert llm.generate(PROMPTS[2], params())[0].token_ids == want(tiny_dirs, llm, PROMPTS[2])
    assert one.output_ids == want(tiny_dirs, llm, PROMPTS[0])[:1] and not llm.has_unfinished()


def test_a_stream_the_garbage_collector_closes_inside_a_step_is_aborted_without_a_deadlock(tiny_dirs, monkeypatch):
    """A stream held only by a reference cycle is closed whenever a collection runs, inside the scheduler's locked
    code too: its clean-up waited there on that same lock, and the step never ended."""
    import gc

    from dflash_trt.engine.scheduler import Scheduler

    llm = _engine(tiny_dirs)
    stream = llm.stream(PROMPTS[0], params())
    next(stream)
    cycle = {"stream": stream}
    cycle["self"] = cycle
    del stream, cycle
    draft_len = Scheduler._draft_len

    def collecting(self, decodes):
        gc.collect()  # the stream's clean-up runs here, the scheduler's lock held
        return draft_len(self, decodes)

    monkeypatch.setattr(Scheduler, "_draft_len", collecting)
    got = []
    caller = threading.Thread(target=lambda: got.extend(llm.generate(PROMPTS[1], params())), daemon=True)
    caller.start()
    caller.join(60)
    assert not caller.is_alive(), "the step waited on the scheduler's lock"
    assert got[0].token_ids == want(tiny_dirs, llm, PROMPTS[1]) and not llm.has_unfinished()


def test_a_stream_waits_for_room_in_a_full_queue_as_generate_does(tiny_dirs):
    """It raised QueueFullError where generate waited for the requests ahead of it."""
    llm = _engine(tiny_dirs, max_batch_size=1, max_queue_len=0)
    ahead = llm.add_request(llm.encode(PROMPTS[0]), params())  # the one row: the queue is full
    chunks = list(llm.stream(PROMPTS[1], params()))
    assert chunks[-1].output.token_ids == want(tiny_dirs, llm, PROMPTS[1])
    assert ahead.output_ids == want(tiny_dirs, llm, PROMPTS[0]) and not llm.has_unfinished()


def test_a_stream_reads_its_stop_strings_from_the_checked_params(tiny_dirs, llm):
    """stop set to None after construction is no stop (generate took it so); the stream's text split raised."""
    sp = params()
    sp.stop = None
    chunks = list(llm.stream(PROMPTS[0], sp))
    assert chunks[-1].output.token_ids == want(tiny_dirs, llm, PROMPTS[0])


def test_sampling_params_for_each_prompt_may_come_as_a_tuple(tiny_dirs, llm):
    """A tuple read as one SamplingParams for every prompt: "params must be a SamplingParams, got tuple"."""
    outs = llm.generate(PROMPTS[:2], (params(), SamplingParams(max_new_tokens=4, ignore_eos=True)))
    assert [o.token_ids for o in outs] == [want(tiny_dirs, llm, PROMPTS[0]), want(tiny_dirs, llm, PROMPTS[1])[:4]]


@pytest.mark.parametrize("messages", ["hello", ["hello"], [("role", "user")]])
def test_encode_chat_takes_a_list_of_message_dicts(llm, messages):
    """A string's characters read as messages: AttributeError "'str' object has no attribute 'get'"."""
    with pytest.raises(TypeError, match="messages must be a list of dicts"):
        llm.encode_chat(messages)
