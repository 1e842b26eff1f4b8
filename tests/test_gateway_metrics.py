"""chatsvc/metrics.py: engine gauges read from stats() at scrape time, latency histograms fed per delta."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from chatsvc.metrics import Metrics, RequestTimer
from engine.protocol import EngineStats
from tests.fake_engine import FakeEngine, tiny_tokenizer


def scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_engine_stats_become_gauges_and_counters(tmp_path: Path) -> None:
    engine = FakeEngine(tiny_tokenizer(tmp_path))
    engine.stats = lambda: EngineStats(kv_blocks_total=64, kv_blocks_free=48, preemptions_swap=3,  # type: ignore[method-assign]
                                       preemptions_recompute=1, prefix_cache_hit_tokens=32,
                                       kv_host_blocks_total=10, kv_host_hit_blocks=7, kv_disk_load_seconds=0.5,
                                       runtime={"kernels": "cpp", "isa": "avx2", "dtype": "float32", "threads": 2,
                                                "fallback": None})
    got = scrape(Metrics(engine))
    assert got[("chatsvc_kv_blocks_total", ())] == 64
    assert got[("chatsvc_kv_usage_ratio", ())] == 0.25
    assert got[("chatsvc_preemptions_total", (("mode", "swap"),))] == 3
    assert got[("chatsvc_preemptions_total", (("mode", "recompute"),))] == 1
    assert got[("chatsvc_prefix_cache_hit_tokens_total", ())] == 32
    assert got[("chatsvc_requests_waiting", ())] == 0  # not set: 0
    assert got[("chatsvc_kv_host_blocks_total", ())] == 10
    assert got[("chatsvc_kv_host_hit_blocks_total", ())] == 7
    assert got[("chatsvc_kv_disk_load_seconds_total", ())] == 0.5
    runtime = (("dtype", "float32"), ("fallback", ""), ("isa", "avx2"), ("kernels", "cpp"), ("threads", "2"))
    assert got[("chatsvc_engine_runtime_info", runtime)] == 1


def test_request_timer_observes_ttft_once_and_spreads_itl(tmp_path: Path) -> None:
    metrics = Metrics(FakeEngine(tiny_tokenizer(tmp_path)))
    timer = RequestTimer(metrics)
    timer.on_tokens(0, 1)
    timer.on_tokens(0, 3)  # one delta of three tokens: three inter-token gaps
    timer.on_tokens(0, 0)  # nothing new: nothing observed
    timer.finish("length")
    got = scrape(metrics)
    assert got[("chatsvc_time_to_first_token_seconds_count", ())] == 1
    assert got[("chatsvc_inter_token_latency_seconds_count", ())] == 3
    assert got[("chatsvc_e2e_request_latency_seconds_count", ())] == 1
    assert got[("chatsvc_requests_finished_total", (("reason", "length"),))] == 1
