"""/metrics' gauges of the cache, read from a scheduler holding requests (no engine needed)."""

from prometheus_client.parser import text_string_to_metric_families

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
