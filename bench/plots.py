"""PNG plots of serving benchmark runs: p90 latency and SLO attainment against load.

matplotlib (the `dev` extra) is imported only here, with the Agg backend (no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.serving_metrics import SLO, Run


def plot_runs(series: dict[str, list[Run]], slo: SLO, prefix: str) -> list[Path]:
    """PREFIX_latency.png (p90 TTFT and p90 TPOT vs load, SLOs dashed) and
    PREFIX_attainment.png (attainment vs load, the 90% line dashed); one line per series."""
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

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = ((axes[0], "ttft_s", slo.ttft_s, "p90 TTFT"), (axes[1], "tpot_s", slo.tpot_s, "p90 TPOT"))
    for ax, metric, limit, title in panels:
        for name, runs in series.items():
            points = [(r.load.x, r.summary[metric]["p90"]) for r in runs if r.summary[metric]["p90"] is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
        ax.axhline(limit, color="red", linestyle="--", label=f"SLO {limit:g} s")
        ax.set(title=title, xlabel=xlabel, ylabel="seconds")
        ax.grid(alpha=0.3)
        ax.legend()
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
