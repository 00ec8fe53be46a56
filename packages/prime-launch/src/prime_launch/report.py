"""Reward and loss curves of a run (metrics.jsonl) as a PNG."""

from __future__ import annotations

from pathlib import Path

from prime_core.monitor import read_metrics

from prime_launch.metrics import series

PANELS = (
    ("orchestrator", "reward/mean", "reward (mean)"),
    ("trainer", "loss/mean", "loss (mean)"),
    ("trainer", "mismatch_kl/mean", "mismatch KL (mean)"),
    ("trainer", "throughput/tokens_per_s", "trainer tokens/s"),
)


def plot_run(metrics_path: Path, out_path: Path, title: str | None = None) -> Path:
    """Plot every panel that has data (SFT runs log ``loss/mean`` under process ``sft``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    if not records:
        why = "" if metrics_path.exists() else " (the run has not finished a step: it writes the file from its first)"
        raise ValueError(f"no metrics in {metrics_path}{why}")
    panels = []
    for process, key, label in PANELS:
        data = series(records, process, key)
        if not data and process == "trainer":
            data = series(records, "sft", key)
        if data:
            panels.append((label, data))
    if not panels:
        raise ValueError(f"{metrics_path} has none of {', '.join(k for _, k, _ in PANELS)}")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (label, data) in zip(axes[:, 0], panels, strict=True):
        steps, values = zip(*data, strict=True)
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, linewidth=1.2)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or str(metrics_path.parent))
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
