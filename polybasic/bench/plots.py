"""PNG picture of a bench document: speedup over vanilla per Spec-Bench category and method."""
from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure

from polybasic.planner.plots import save_png, short


def _title(doc: dict) -> str:
    m, model = doc.get("machine", {}), doc.get("config", {}).get("model")
    where = ", ".join(x for x in (m.get("cpu"), m.get("gpu") and f"GPU {m['gpu']}", m.get("dtype")) if x)
    return "Speedup over vanilla per Spec-Bench category" + (f", model {short(str(model), 50)}" if model else "") \
        + (f"\n{where}" if where else "")


def plot_speedup(doc: dict, path: str | Path) -> Path:
    """Grouped bars: one group per category (as in the report's table) and 'overall', one bar per
    method; a missing speedup (None) leaves a gap. A dashed line marks 1.0x (vanilla)."""
    methods = list(doc.get("methods", {}))
    cats = list(doc["methods"][methods[0]].get("per_category", {})) if methods else []
    groups = cats + ["overall"]
    # speedup[m][g]: x over vanilla, nan where missing
    speed = {m: [doc["methods"][m].get("per_category", {}).get(c, {}).get("speedup") for c in cats]
             + [doc["methods"][m].get("speedup")] for m in methods}
    width = 0.8 / max(1, len(methods))
    fig = Figure(figsize=(min(18.0, 3.0 + len(groups) * max(1.0, 0.35 * len(methods))), 4.5))
    ax = fig.add_subplot()
    for i, m in enumerate(methods):
        ys = [math.nan if v is None else v for v in speed[m]]
        bars = ax.bar([g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))], ys, width,
                      label=short(m))
        if len(methods) * len(groups) <= 30:
            ax.bar_label(bars, labels=["" if math.isnan(y) else f"{y:.2f}" for y in ys], fontsize=7, padding=1)
    ax.axhline(1.0, color="black", ls="--", lw=0.9)
    ax.set_xticks(range(len(groups)), groups, rotation=30 if len(groups) > 6 else 0,
                  ha="right" if len(groups) > 6 else "center")
    ax.set(ylabel="speedup (x vanilla tokens/s)", title=_title(doc))
    ax.margins(y=0.12)
    ax.grid(True, axis="y", alpha=0.3)
    if methods:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="method")
    return save_png(fig, path)
