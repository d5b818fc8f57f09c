"""The bench's outputs: a table on stdout, JSON, and a PNG bar chart of tokens/s per user."""

from __future__ import annotations

import json
from pathlib import Path


def label(run: dict) -> str:
    return run["engine"] + (f" K={run['num_draft_tokens']}" if run["num_draft_tokens"] else "")


def table(result: dict) -> str:
    runs = result["runs"]
    plain = next(r for r in runs if r["engine"] == "redline")["tps_user_median"]
    hf = next((r["tps_user_median"] for r in runs if r["engine"] == "hf"), None)
    head = f"{'engine':<20}{'tok/s median':>13}{'min':>8}{'max':>8}{'TTFT ms':>9}{'accept':>8}{'draft %':>8}"
    head += f"{'x plain':>8}" + (f"{'x hf':>7}" if hf else "") + f"{'warmup s':>9}  per-position acceptance"
    lines = [head]
    for r in runs:
        accept = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        share = f"{100 * r['draft_share']:.0f}" if r["draft_share"] is not None else "-"
        line = (
            f"{label(r):<20}{r['tps_user_median']:>13.1f}{r['tps_user_min']:>8.1f}{r['tps_user_max']:>8.1f}"
            f"{1e3 * r['ttft_s_median']:>9.1f}{accept:>8}{share:>8}{r['tps_user_median'] / plain:>8.2f}"
        )
        if hf:
            line += f"{r['tps_user_median'] / hf:>7.2f}"
        rates = "/".join(f"{a:.2f}" for a in r["acceptance_rates"] or [])
        lines.append(line + f"{r['warmup_s']:>9.1f}  {rates or '-'}")
    return "\n".join(lines)


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = [label(r) for r in runs]
    medians = [r["tps_user_median"] for r in runs]
    errors = [
        [m - r["tps_user_min"] for m, r in zip(medians, runs, strict=True)],
        [r["tps_user_max"] - m for m, r in zip(medians, runs, strict=True)],
    ]
    fig, ax = plt.subplots(figsize=(1.4 * len(runs) + 2, 4))
    colors = {"hf": "#999999", "redline": "#4c72b0", "redline+eagle3": "#dd8452"}
    bars = ax.bar(names, medians, yerr=errors, capsize=4, color=[colors[r["engine"]] for r in runs])
    for bar, r in zip(bars, runs, strict=True):
        if r["acceptance_length"]:
            middle = (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2)
            text = f"acceptance\n{r['acceptance_length']:.2f}"
            ax.annotate(text, middle, ha="center", va="center", fontsize=8, color="white")
    m = result.get("machine", {})
    ax.set_ylabel("tokens/s per user (batch 1, greedy)")
    model = "/".join(Path(result["settings"]["model"]).parts[-2:])
    ax.set_title(f"{model}: {m.get('cpu', '')}, {m.get('threads', '?')} threads")
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
