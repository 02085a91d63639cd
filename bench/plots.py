"""PNG plots of serving benchmark runs: p90 latency and SLO attainment against load.

matplotlib (the `dev` extra) is imported only here, with the Agg backend (no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.serving_metrics import SLO, Run


def plot_runs(series: dict[str, list[Run]], slo: SLO, prefix: str) -> list[Path]:
    """PREFIX_latency.png (p90 TTFT, p90 TPOT and p99 ITL vs load, SLOs dashed; a panel
    whose values span more than 20x is drawn on a log scale) and PREFIX_attainment.png
    (attainment vs load, the 90% line dashed); one line per series."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[dev]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.serving_metrics import GOOD_ATTAINMENT

    key = next((runs[0].load.key for runs in series.values() if runs), "rate")
    xlabel = "request rate (req/s)" if key == "rate" else "concurrency (streams)"
    paths = [Path(f"{prefix}_latency.png"), Path(f"{prefix}_attainment.png")]

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    panels = ((axes[0], "ttft_s", "p90", slo.ttft_s, "p90 TTFT"), (axes[1], "tpot_s", "p90", slo.tpot_s, "p90 TPOT"),
              (axes[2], "itl_s", "p99", None, "p99 ITL"))
    for ax, metric, q, limit, title in panels:
        values = []
        for name, runs in series.items():
            points = [(r.load.x, r.summary[metric][q]) for r in runs if r.summary[metric].get(q) is not None]
            values += [y for _, y in points]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
        if limit is not None:
            ax.axhline(limit, color="red", linestyle="--", label=f"SLO {limit:g} s")
        positive = [v for v in values if v > 0]
        if positive and max(positive) > 20 * min(positive):
            ax.set_yscale("log")
        ax.set(title=title, xlabel=xlabel, ylabel="seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in series.items():
        ax.plot([r.load.x for r in runs], [r.summary["slo_attainment"] for r in runs], marker="o", label=name)
    ax.axhline(GOOD_ATTAINMENT, color="red", linestyle="--", label=f"{GOOD_ATTAINMENT:.0%}")
    ax.set(title=f"SLO attainment (TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s)", xlabel=xlabel,
           ylabel="share of requests", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
