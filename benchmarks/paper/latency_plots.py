"""The figures of ``latency_vs_rate.py``: normalized latency against request rate (Figs. 12, 14, 17) and the
average batched requests (Fig. 13), as PNG. Each latency panel marks the sustained-rate threshold."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from latency_vs_rate import Sweep

MARKERS = {"paged": "o", "max": "s", "pow2": "^", "oracle": "D"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _latency_panel(ax: Any, sweep: Sweep, labels: dict[str, str], title: str) -> None:
    for policy, marker in MARKERS.items():
        curve = sweep.curve(policy)
        if not curve:
            continue
        ax.plot([r.rate for r in curve], [r.normalized_latency for r in curve], marker=marker, label=labels[policy])
        stopped = [r for r in curve if r.stopped]
        if stopped:
            ax.scatter([r.rate for r in stopped], [r.normalized_latency for r in stopped], facecolors="none",
                       edgecolors="black", s=90, zorder=3)
    ax.axhline(sweep.threshold, color="grey", linestyle="--", linewidth=0.8, label="threshold")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def plot_fig12(sharegpt: Sweep, alpaca: Sweep, path: Path, labels: dict[str, str]) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    _latency_panel(axes[0], sharegpt, labels, "ShareGPT (Fig. 12a); circled: stopped, a lower bound")
    _latency_panel(axes[1], alpaca, labels, "Alpaca-like (Fig. 12b)")
    fig.suptitle("SmolLM2-135M on 2 CPU cores: paged KV against Orca reservations", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_batched(sharegpt: Sweep, alpaca: Sweep, path: Path, labels: dict[str, str]) -> Path:
    """Mean batched requests of each system at the highest rate every system ran (Fig. 13)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, sweep, name in ((axes[0], sharegpt, "ShareGPT"), (axes[1], alpaca, "Alpaca-like")):
        policies = [p for p in MARKERS if sweep.curve(p)]
        common = min(max(r.rate for r in sweep.curve(p)) for p in policies)
        values = [next(r.mean_batched for r in sweep.curve(p) if r.rate == common) for p in policies]
        bars = ax.bar([labels[p] for p in policies], values)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_ylabel("mean batched requests")
        ax.set_title(f"{name} at {common:.3f} req/s (Fig. 13)", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_fig14(sweeps: list[Sweep], path: Path, labels: dict[str, str]) -> Path:
    plt = _pyplot()
    columns = max(1, (len(sweeps) + 1) // 2)
    fig, axes = plt.subplots(2, columns, figsize=(4 * columns, 7), squeeze=False)
    for ax, sweep in zip(axes.flat, sweeps, strict=False):
        _latency_panel(ax, sweep, labels, sweep.workload)
    fig.suptitle("Parallel sampling (n) and beam search (width) on the Alpaca-like trace (Fig. 14)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_chatbot(sweep: Sweep, path: Path, labels: dict[str, str]) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    _latency_panel(ax, sweep, labels, "Chatbot: the last 1,024 tokens of a conversation (Fig. 17)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
