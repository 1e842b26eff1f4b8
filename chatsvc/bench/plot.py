"""PNG figures (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path
from typing import Any

from chatsvc.bench.metrics import RequestRecord, throughput_timeline


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values: list[float]) -> None:
    if not values:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ax.step(sorted(values), [(i + 1) / len(values) for i in range(len(values))], where="post")


def _save(fig: Any, path: str | Path, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def plot_run(records: list[RequestRecord], t0: float, path: str | Path, title: str = "chatsvc bench") -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) and output throughput over time."""
    plt = _pyplot()
    done = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    series = [
        ("TTFT (ms)", [r.ttft * 1000 for r in done if r.ttft is not None]),
        ("TPOT (ms)", [r.tpot * 1000 for r in done if r.tpot is not None]),
        ("ITL (ms)", [g * 1000 for r in done for g in r.itls]),
        ("E2E latency (s)", [r.latency for r in done if r.latency is not None]),
    ]
    for ax, (label, values) in zip(axes.flat, series, strict=False):
        _cdf(ax, values)
        ax.set(xlabel=label, ylabel="fraction of requests" if "ITL" not in label else "fraction of gaps")
    # About 40 bins over the run, at least 0.1 s each, so short and long runs both show a shape.
    span = max((t - t0 for r in done for t in r.delta_times), default=1.0)
    bin_s = max(0.1, span / 40)
    timeline = throughput_timeline(done, t0, bin_s)
    if timeline:
        axes.flat[4].step([t for t, _ in timeline], [v for _, v in timeline], where="mid")
    axes.flat[4].set(xlabel="time since start (s)", ylabel=f"output tokens / s ({bin_s:.2g} s bins)")
    # Requests in flight over time: +1 at each start, -1 at each end.
    events = sorted([(r.start - t0, 1) for r in records] + [((r.end or r.start) - t0, -1) for r in records])
    axes.flat[5].step([0.0, *(t for t, _ in events)], [0, *accumulate(d for _, d in events)], where="post")
    axes.flat[5].set(xlabel="time since start (s)", ylabel="requests in flight")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    _save(fig, path, title)


def plot_sweep(points: list[dict[str, Any]], path: str | Path, title: str = "request-rate sweep") -> None:
    """The PagedAttention paper's picture: normalized latency (s/token) against request rate, one curve per
    server; goodput (or request throughput without an SLO) beside it."""
    fig, (ax1, ax2) = _pyplot().subplots(1, 2, figsize=(12, 4.5))
    labels = list(dict.fromkeys(str(p["label"]) for p in points))
    has_slo = any(p.get("goodput_req_s") is not None for p in points)
    for label in labels:
        ps = sorted((p for p in points if str(p["label"]) == label), key=lambda p: p["rate"])
        rates = [p["rate"] for p in ps]
        ax1.plot(rates, [p.get("normalized_latency_s_per_token") for p in ps], marker="o", label=label)
        key = "goodput_req_s" if has_slo else "request_s"
        ax2.plot(rates, [p.get(key) for p in ps], marker="o", label=label)
    ax1.set(xlabel="request rate (sessions/s)", ylabel="normalized latency (s/token)")
    ax2.set(xlabel="request rate (sessions/s)",
            ylabel="goodput (req/s)" if has_slo else "request throughput (req/s)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path, title)
