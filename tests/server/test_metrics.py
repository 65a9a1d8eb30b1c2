"""/metrics' gauges of the cache, read from a scheduler holding requests (no engine needed)."""

from prometheus_client.parser import text_string_to_metric_families

from dflash_trt.bench.endpoint_metrics import (VLLM_ACCEPTED, VLLM_ACCEPTED_PER_POS, VLLM_DRAFT_TOKENS, VLLM_DRAFTS,
                                                acceptance_delta, parse_metrics)
from dflash_trt.engine.scheduler import Scheduler, SchedulerConfig
from dflash_trt.engine.sequence import Sequence
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.server.metrics import ServerMetrics


def gauges(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_cache_gauges_count_rows_and_the_positions_running_requests_hold():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_model_len=50, max_prefill_tokens=16))
    metrics = ServerMetrics(sched, max_draft_len=3)
    assert gauges(metrics)["dflash_cache_rows"] == 4 and gauges(metrics)["dflash_kv_cache_usage"] == 0
    decoding = Sequence(list(range(10)), SamplingParams(max_new_tokens=20))
    prefilling = Sequence(list(range(40)), SamplingParams(max_new_tokens=5))
    sched.add(decoding)
    sched.add(prefilling)
    batch = sched.schedule()  # decoding's whole prompt; the 40-token prompt's first chunk waits for a budget of 16
    assert [len(c) for c in batch.prefills] == [10]
    decoding.num_prefilled = 10
    decoding.output_ids = [1, 2, 3]  # 13 tokens, the last not yet cached
    sched.schedule()
    prefilling.num_prefilled = 16
    assert gauges(metrics)["dflash_kv_cache_usage"] == (12 + 16) / (4 * 50)
    sched.finish(decoding)
    assert gauges(metrics)["dflash_kv_cache_usage"] == 16 / (4 * 50)


def test_request_latencies_are_observed_as_vllms_are():
    from dflash_trt.engine.llm_engine import RequestOutput

    metrics = ServerMetrics(Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=50)), max_draft_len=3)
    out = RequestOutput(prompt_token_ids=[1, 2], token_ids=[5, 6, 7, 8, 9], text="", finish_reason="length",
                        decode_time=0.2, time_to_first_token=0.3, latency=0.55)
    metrics.observe_finished(out)
    metrics.observe_finished(RequestOutput([1], [], "", "abort"))  # aborted in the queue: no token, no latency
    g = gauges(metrics)
    assert g["dflash_time_to_first_token_seconds_count"] == 1 and g["dflash_time_to_first_token_seconds_sum"] == 0.3
    assert g["dflash_time_per_output_token_seconds_sum"] == 0.2 / 4  # over the 4 tokens after the first
    assert g["dflash_e2e_request_latency_seconds_count"] == 1 and g["dflash_e2e_request_latency_seconds_sum"] == 0.55


def test_vllms_metric_names_carry_the_same_figures_for_dashboards_and_tools_built_on_vllm():
    from dflash_trt.engine.llm_engine import RequestOutput
    from dflash_trt.server.metrics import VLLM_NAMES

    metrics = ServerMetrics(Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=50)), 3, model_name="m")
    outs = [RequestOutput([1, 2], [5, 6, 7, 8], "", "stop", acceptance_lengths=[3, 1], draft_lens=[3, 3], tau=2.0,
                          time_to_first_token=0.1, latency=0.4, decode_time=0.2),
            RequestOutput([1], [5, 6], "", "length", acceptance_lengths=[2], draft_lens=[6], tau=2.0, latency=0.2)]
    for out in outs:
        metrics.observe_finished(out)
    speculative_steps(metrics, [([3, 2], 3), ([1], 6)])  # the same steps: two rows drafting 3, then one tree of 6
    text = metrics.render().decode()
    samples = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    ours = {(n, tuple(sorted(labels.items()))): v for n, labels, v in samples if n.startswith("dflash_")}
    theirs = {(n, tuple(sorted(labels.items()))): v for n, labels, v in samples if n.startswith("vllm:")}
    for (name, labels), value in ours.items():
        family = next((f for f in VLLM_NAMES if name.startswith(f)), None)
        if family is None or name.endswith("_created"):
            continue
        renamed = VLLM_NAMES[family] + name[len(family):]
        renamed_labels = {("finished_reason" if k == "finish_reason" else k): v for k, v in labels}
        vllm_labels = tuple(sorted({"model_name": "m", "engine": "0", **renamed_labels}.items()))
        assert theirs[(renamed, vllm_labels)] == value, renamed
    assert theirs[("vllm:request_success_total", (("engine", "0"), ("finished_reason", "length"),
                                                  ("model_name", "m")))] == 1
    # the names as vllm/v1/metrics/loggers.py writes them (not this module's own table)
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_sum",
            "vllm:request_time_per_output_token_seconds_sum", "vllm:e2e_request_latency_seconds_sum"} <= {
        name for name, _ in theirs}
    # vLLM's spec-decode counters, read as a bench reads vLLM: 3 steps committing 3, 2 and 1 tokens over 12 drafted
    read = acceptance_delta({}, {k: v for k, v in parse_metrics(text).items() if k.startswith("vllm:")})
    assert read["tau"] == (3 + 2 + 1) / 3 and read["acceptance_rate"] == (2 + 1 + 0) / 12
    assert read["acceptance_per_position"] == [2 / 3, 1 / 3, 0]  # first drafts accepted twice, second once, none third


def speculative_steps(metrics: ServerMetrics, steps: list[tuple[list[int], int]]) -> None:
    """Steps of rows that committed the given tokens each (the bonus included), each row verifying `drafts`."""
    from dflash_trt.engine.llm_engine import StepResult
    from dflash_trt.engine.scheduler import ScheduledBatch

    for committed, drafts in steps:
        rows = [Sequence([1], SamplingParams()) for _ in committed]
        metrics.observe_step(StepResult(ScheduledBatch([], rows, drafts, []), acceptance_lengths=committed,
                                        num_draft=drafts, draft_tokens=drafts))


def test_spec_decode_counters_move_every_step_not_when_requests_end():
    """As vLLM's: a scrape while a long answer streams sees its drafts; a request that finishes adds nothing more."""
    from dflash_trt.engine.llm_engine import RequestOutput

    metrics = ServerMetrics(Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=50)), 4, model_name="m")
    empty = parse_metrics(metrics.render().decode())
    assert empty[f"{VLLM_ACCEPTED_PER_POS}:3"] == 0  # each position there from the start, as vLLM's
    speculative_steps(metrics, [([5, 1], 4)])
    first = parse_metrics(metrics.render().decode())
    assert (first[VLLM_DRAFTS], first[VLLM_DRAFT_TOKENS], first[VLLM_ACCEPTED]) == (2, 8, 4)
    assert [first[f"{VLLM_ACCEPTED_PER_POS}:{p}"] for p in range(4)] == [1, 1, 1, 1]
    metrics.observe_finished(RequestOutput([1], [5] * 6, "", "length", acceptance_lengths=[5], draft_lens=[4],
                                           tau=5.0))
    assert parse_metrics(metrics.render().decode()) == first
    speculative_steps(metrics, [([7], 6)])  # a context lookup's branch may run deeper than K
    deeper = parse_metrics(metrics.render().decode())
    assert [deeper[f"{VLLM_ACCEPTED_PER_POS}:{p}"] for p in range(6)] == [2, 2, 2, 2, 1, 1]


def test_tokens_are_counted_as_steps_make_them_not_when_the_request_ends():
    """vLLM's counters move every step: a dashboard's token rate shows a long answer while it streams."""
    from dflash_trt.engine.llm_engine import StepResult
    from dflash_trt.engine.scheduler import ScheduledBatch

    metrics = ServerMetrics(Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=50)), 3)
    seq = Sequence([1, 2, 3], SamplingParams(max_new_tokens=8))
    queued = Sequence([4, 5], SamplingParams(max_new_tokens=8))
    queued.finish_reason = "abort"  # aborted before its prefill: no prompt was cached, no token made

    def step(tokens: list[int], updated=(seq,)) -> dict[str, float]:
        seq.output_ids += tokens
        metrics.observe_step(StepResult(ScheduledBatch([], [seq], 3, []), list(updated)))
        return gauges(metrics)

    first = step([7])
    assert (first["dflash_prompt_tokens_total"], first["dflash_generation_tokens_total"]) == (3, 1)
    assert step([8, 9, 10])["dflash_generation_tokens_total"] == 4  # a step that accepted two drafts and a bonus
    seq.finish_reason = "stop"
    counted = step([11], updated=(seq, queued))
    assert (counted["dflash_prompt_tokens_total"], counted["dflash_generation_tokens_total"]) == (3, 5)
    assert counted["vllm:generation_tokens_total"] == 5
