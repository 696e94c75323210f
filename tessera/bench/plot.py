"""Latency percentiles against concurrency, from several `tessera bench serving` result files.

    tessera bench serving --plot latency.png --from-json c1.json c8.json c32.json
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

PANELS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency"))
SERIES = (("median", "p50", "-o"), ("p90", "p90", "--s"), ("p99", "p99", ":^"))


def load_results(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        try:
            d = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"from_json: cannot read {p}: {e}") from None
        if "metrics" not in d or "config" not in d:
            raise ValueError(f"from_json: {p} is not a `tessera bench serving` result (no metrics/config)")
        out.append(d)
    return out


def x_value(result: dict) -> float:
    """The load level of a run: its concurrency cap, or else the number of prompts (all in flight at once)."""
    cfg = result["config"]
    return float(cfg.get("max_concurrency") or cfg.get("num_prompts") or 0)


def plot_latency_vs_concurrency(results: list[dict], out_png: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only: the benchmark may run on a machine without a display
    import matplotlib.pyplot as plt

    if not results:
        raise ValueError("from_json: give at least one result file to plot")
    # Runs at the same load level (repeats) collapse to their median, so each x has one point.
    by_x: dict[float, list[dict]] = {}
    for r in results:
        by_x.setdefault(x_value(r), []).append(r)
    xs = sorted(by_x)
    fig, grid = plt.subplots(2, 2, figsize=(9.5, 7.0))
    axes = list(grid.flat)
    for ax, (key, title) in zip(axes, PANELS):
        for stat, label, style in SERIES:
            pts = []
            for x in xs:
                vals = [r["metrics"][key][stat] for r in by_x[x] if r["metrics"][key][stat] is not None]
                if vals:
                    pts.append((x, statistics.median(vals)))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.set_title(title)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel("ms")
        if len(set(xs)) > 1 and max(xs) / max(min(xs), 1) >= 8:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    first = by_x[xs[0]][0]
    fig.suptitle(f"{first.get('model', '?')} — {first['config'].get('dataset', '?')}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
