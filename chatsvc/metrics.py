"""Prometheus metrics on a private registry per app.

Engine gauges and counters are read from ``engine.stats()`` (``engine.protocol.EngineStats``) at scrape time by a custom collector;
latency histograms and stream gauges are updated by the gateway as requests flow.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.client import EngineClient
from engine.protocol import EngineStats

# CPU serving is slow and noisy: latency buckets reach into tens of seconds.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class EngineCollector(Collector):
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        total, free = s.kv_blocks_total, s.kv_blocks_free
        gauges = {
            "kv_blocks_total": ("Device KV cache blocks", total),
            "kv_blocks_free": ("Device KV blocks no sequence holds (includes cached)", free),
            "kv_blocks_cached": ("Free blocks kept for prefix reuse", s.kv_blocks_cached),
            "kv_usage_ratio": ("Fraction of device KV blocks held", (total - free) / total if total else 0.0),
            "cpu_blocks_total": ("CPU swap blocks", s.cpu_blocks_total),
            "cpu_blocks_free": ("Free CPU swap blocks", s.cpu_blocks_free),
            "requests_running": ("Requests running", s.requests_running),
            "requests_waiting": ("Requests waiting", s.requests_waiting),
            "requests_swapped": ("Requests swapped out to CPU", s.requests_swapped),
            "kv_host_blocks_total": ("KV blocks of the host tier", s.kv_host_blocks_total),
            "kv_host_blocks_cached": ("Host-tier blocks holding a restorable block", s.kv_host_blocks_cached),
            "kv_host_bytes": ("Bytes of the host tier", s.kv_host_bytes),
            "kv_disk_blocks": ("Blocks on the disk tier", s.kv_disk_blocks),
            "kv_disk_bytes": ("Bytes the disk tier's files take (headers counted at their allowance)", s.kv_disk_bytes),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"chatsvc_{name}", doc, value=float(value))
        counters = {
            "prefix_cache_queried_tokens": ("Prompt tokens looked up in the prefix cache", s.prefix_cache_queried_tokens),
            "prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache", s.prefix_cache_hit_tokens),
            "stream_deltas_coalesced": ("Deltas merged into an earlier one for a slow reader", s.stream_deltas_coalesced),
            "streams_overflowed": ("Requests aborted because their reader fell too far behind", s.streams_overflowed),
            "kv_host_hit_blocks": ("Blocks restored from the host tier instead of recomputed", s.kv_host_hit_blocks),
            "kv_host_offloaded_blocks": ("Evicted device blocks copied to the host tier", s.kv_host_offloaded_blocks),
            "kv_disk_hit_blocks": ("Blocks read from the disk tier", s.kv_disk_hit_blocks),
            "kv_disk_spilled_blocks": ("Host-tier blocks handed to the disk tier", s.kv_disk_spilled_blocks),
            "kv_disk_failed_loads": ("Disk reads that found no valid file (recomputed)", s.kv_disk_failed_loads),
            "kv_disk_dropped_files": ("Disk-tier files deleted as corrupt, truncated or foreign", s.kv_disk_dropped_files),
            "kv_disk_write_failures": ("Disk-tier writes that failed (disk full)", s.kv_disk_write_failures),
            "kv_disk_load_seconds": ("Disk read start to host-tier install, summed over kv_disk_hit_blocks",
                                     s.kv_disk_load_seconds),
            "kv_warm_loaded_blocks": ("Host-tier blocks a session warm copied into the pool", s.kv_warm_loaded_blocks),
            "kv_warm_read_blocks": ("Disk-tier blocks a session warm started reading", s.kv_warm_read_blocks),
            "kv_host_preloaded_blocks": ("Disk-tier blocks the start-up preload put in the host tier",
                                         s.kv_host_preloaded_blocks),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"chatsvc_{name}", doc, value=float(value))
        pre = CounterMetricFamily("chatsvc_preemptions", "Preempted sequence groups", labels=["mode"])
        pre.add_metric(["swap"], float(s.preemptions_swap))
        pre.add_metric(["recompute"], float(s.preemptions_recompute))
        yield pre
        if s.runtime:
            yield InfoMetricFamily("chatsvc_engine_runtime", "What the engine computes with: kernel set, ISA, dtype, "
                                   "threads", value={k: "" if v is None else str(v) for k, v in s.runtime.items()})
        yield from _worker_metrics(s)


def _worker_metrics(s: EngineStats) -> Iterator[Metric]:
    """Per-worker gauges of an engine spread over workers (``chatsvc.remote_engine``)."""
    if s.route_decisions is not None:
        routes = CounterMetricFamily("chatsvc_route_decisions", "Requests placed on a worker, by why",
                                     labels=["reason"])
        for reason, n in s.route_decisions.items():
            routes.add_metric([reason], float(n))
        yield routes
    if not s.workers:
        return
    yield CounterMetricFamily("chatsvc_worker_hop_seconds", "Worker write to gateway read of output "
                              "entries (one per request per engine step), summed", value=s.hop_seconds)
    yield CounterMetricFamily("chatsvc_worker_hop_entries", "Output entries read from workers",
                              value=float(s.hop_entries))
    # Each named after the WorkerStats field it reports.
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    per_worker = {
        "kv_blocks_total": (gauge, "Device KV cache blocks of the worker"),
        "kv_blocks_free": (gauge, "Device KV blocks no sequence holds on the worker (includes cached)"),
        "requests_running": (gauge, "Requests running on the worker"),
        "requests_waiting": (gauge, "Requests waiting on the worker"),
        "requests_swapped": (gauge, "Requests swapped out to CPU on the worker"),
        "prefix_cache_hit_tokens": (counter, "Prompt tokens served from the worker's prefix cache"),
    }
    for name, (family, doc) in per_worker.items():
        metric = family(f"chatsvc_worker_{name}", doc, labels=["worker"])
        for wid, ws in s.workers.items():
            metric.add_metric([wid], float(getattr(ws, name)))
        yield metric


class Metrics:
    def __init__(self, engine: EngineClient) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        r.register(EngineCollector(engine))
        self.ttft = Histogram("chatsvc_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("chatsvc_inter_token_latency_seconds", "Time between streamed tokens", registry=r,
                             buckets=_ITL_BUCKETS)
        self.e2e = Histogram("chatsvc_e2e_request_latency_seconds", "Request latency, arrival to finish",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.finished = Counter("chatsvc_requests_finished", "Finished requests by reason", ["reason"], registry=r)
        self.open_streams = Gauge("chatsvc_open_streams", "Open client streams", ["transport"], registry=r)
        # Engine requests this gateway has started and not yet closed: a draining gateway waits for 0.
        self.generations = Gauge("chatsvc_generations_in_flight", "Engine requests this gateway relays", registry=r)
        self.generations_in_flight = 0
        # Label children resolved once: streams open and close often.
        self.open_sse = self.open_streams.labels("sse")
        self.open_ws = self.open_streams.labels("ws")
        self.quota_refused = Counter("chatsvc_quota_refused", "Requests refused by a per-key quota", ["quota"],
                                     registry=r)
        self.finished_by_reason = {reason: self.finished.labels(reason) for reason in ("stop", "length", "abort",
                                                                                      "error")}

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Feeds one request's deltas into the latency histograms."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: dict[int, float] = {}  # per sample index

    def on_tokens(self, index: int, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if not self.last:  # the request's first tokens
            self.metrics.ttft.observe(now - self.start)
        if index in self.last:
            # Tokens of one delta arrived together; spread the gap over them.
            gap = (now - self.last[index]) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self.last[index] = now

    def finish(self, reason: str) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.start)
        child = self.metrics.finished_by_reason.get(reason)
        (child if child is not None else self.metrics.finished.labels(reason)).inc()
