"""The bench's outputs: a table on stdout, JSON, and a PNG bar chart of tokens/s per user."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import median


def label(run: dict) -> str:
    name = run["engine"] + (" compiled" if run.get("compiled") else "")
    name += f" TP={run['tensor_parallel_size']}" if run.get("tensor_parallel_size", 1) > 1 else ""
    return name + (f" K={run['num_draft_tokens']}" if run["num_draft_tokens"] else "")


def plain_of(runs: list[dict], run: dict) -> dict:
    """The redline plain run in `run`'s mode (compiled or eager; the first mode for other engines)."""
    plains = [r for r in runs if r["engine"] == "redline"]
    same_mode = [r for r in plains if r["compiled"] == run["compiled"]]
    return (same_mode if run["engine"].startswith("redline") and same_mode else plains)[0]


def paired_ratio(run: dict, other: dict) -> float:
    """The median over completions of run's rate / other's on the same prompt in the same round (run.py's
    rates: repeat after repeat, prompt after prompt)."""
    return median(a / b for a, b in zip(run["rates"], other["rates"], strict=True))


def table(result: dict) -> str:
    runs = result["runs"]
    hf = any(r["engine"] == "hf" for r in runs)
    head = f"{'engine':<30}{'tok/s median':>13}{'min':>8}{'max':>8}{'roofline %':>11}{'TTFT ms':>9}"
    head += f"{'accept':>8}{'draft %':>8}{'x plain':>8}" + (f"{'x hf':>7}" if hf else "")
    head += f"{'warmup s':>9}{'same tokens':>12}  per-position acceptance"
    lines = [head]
    for r in runs:
        accept = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        share = f"{100 * r['draft_share']:.0f}" if r["draft_share"] is not None else "-"
        line = (
            f"{label(r):<30}{r['tps_user_median']:>13.1f}{r['tps_user_min']:>8.1f}{r['tps_user_max']:>8.1f}"
            f"{r['roofline_pct']:>11.0f}{1e3 * r['ttft_s_median']:>9.1f}{accept:>8}{share:>8}"
            f"{r['x_plain']:>8.2f}"
        )
        if hf:
            line += f"{r['x_hf']:>7.2f}"
        rates = "/".join(f"{a:.2f}" for a in r["acceptance_rates"] or [])
        if r.get("draft_step_share") is not None and r["draft_step_share"] < 1:
            rates += f" (drafted {100 * r['draft_step_share']:.0f}% of steps)"
        same = "yes" if r["tokens_equal_plain"] else "no"
        lines.append(line + f"{r['warmup_s']:>9.1f}{same:>12}  {rates or '-'}")
    bound = result["roofline"]
    lines.append(
        f"roofline: {bound['weight_bytes'] / 1e6:.0f} MB of weights per step at "
        f"{bound['bandwidth_gbps']:.1f} GB/s (measured in this run: {bound['bandwidth_gbps_before']:.1f} "
        f"before the rounds, {bound['bandwidth_gbps_after']:.1f} after) "
        f"= {bound['tps']:.0f} tokens/s per user at one token per step"
    )
    lines += [f"not run: {failure}" for failure in result.get("failures", [])]
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
    bars = ax.bar(
        names, medians, yerr=errors, capsize=4, color=[colors.get(r["engine"], "#55a868") for r in runs]
    )
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
