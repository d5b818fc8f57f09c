"""`redline bench`: HF generate, redline plain decode and redline + EAGLE-3 for each K, in one process, on the
same weights, prompts, dtype and thread count; batch 1, greedy, fixed-length completions. With `ngram`, n-gram
lookup rows too: redline+ngram for each K, and beside a draft redline+eagle3+ngram; with `trees`, the draft as
each tree of depth K too (redline+eagle3 tree TOPKxNODES; with `ngram` also redline+eagle3+ngram tree
TOPKxNODES).

Prompts: windows of `prompt_len` tokens cut from the stdlib held-out files, or with `data` the first whole
prompts of a held-out set (HumanEval raw; ShareGPT's first user turn in the chat template). Every engine is
loaded (and compiled) first, completes one warm-up prompt (warmup_s: that completion, plus redline's start-up
compile), and then the engines take turns: each prompt, repeat after repeat, is completed by every engine in a
row (rounds.py). A VM's bandwidth drifts by tens of percent within minutes, so an engine measured minutes
after another can look faster or slower by more than the difference between them; in turns, every engine meets
the same drift. tokens/s per user is the decode rate of one completion, (N - 1) / (t_last - t_first); median,
min and max are over all prompts x repeats, and x_plain is the median of each completion's rate over redline
plain's on the same prompt in the same round. With `sequential` (or when the engines do not fit in memory
together, or run tensor-parallel: one process group at a time) each engine runs all its completions alone, one
after another.

redline runs eager, compiled, or both (`modes`), and its rows run again in each of `quantizations` (int4,
int8 on load, gguf: a GGUF's own tensors; "redline int4", ...), each with its own weight bytes; with a GGUF
model and llama-cpp-python installed, llama.cpp runs the GGUF file and an F16 copy of its dequantized
weights (llamacpp.py), and with int8 rows a Q8_0 copy too.

Roofline: a batch-1 decode step reads every weight of the target once, so no engine can produce more than
bandwidth / weight bytes tokens per step-time; the bandwidth is measured in the same run, before the rounds
and after them (machine.read_bandwidth_gbps; the bound takes their mean) and each run's roofline_pct is its
median tokens/s against that bound (speculation can pass 100%: it produces several tokens per read of the
weights). A llama.cpp row's bound is its own file's tensor bytes, a quantized redline row's its model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from statistics import median

import torch

from redline.benchmark.contenders import (
    Contender,
    HFContender,
    LlamaCppContender,
    RedlineContender,
    weight_bytes_per_token,
)
from redline.benchmark.machine import read_bandwidth_gbps
from redline.benchmark.prompts import engine_prompts
from redline.benchmark.report import paired_ratio, plain_of
from redline.benchmark.rounds import Measured, fit_together, in_turns
from redline.dtypes import parse_dtype
from redline.tokenizer import Tokenizer
from redline.train.draft import held_out_prompts


@dataclass(frozen=True)
class BenchSettings:
    max_tokens: int = 128
    num_prompts: int = 4
    prompt_len: int = 64
    repeats: int = 3
    dtype: str = "float32"
    modes: tuple[bool, ...] = (True,)  # redline runs with compile=False and/or compile=True
    hf: bool = True
    data: str | None = None  # "sharegpt" | "humaneval": whole prompts from that held-out set (prompts.py)
    gguf_files: tuple[Path, ...] = ()  # llama.cpp runs each of these files
    tensor_parallel_size: int = 1  # redline over N processes (the roofline stays the whole model's bytes)
    expert_parallel: bool = False
    ngram: tuple[int, int] | None = None  # n-gram lookup rows: prompt_lookup_min, prompt_lookup_max
    trees: tuple[tuple[int, int], ...] = ()  # draft tree rows beside the chain's: (topk, num_draft_tokens)
    sequential: bool = False  # each engine alone, one after another, not in turns
    quantizations: tuple[str, ...] = ()  # redline's rows again in each: "int4", "int8", "gguf"
    group_size: int = 32  # int4's and int8's weights per group


def tree_at(k: int, tree: tuple[int, int]) -> tuple[int, int]:
    """(topk, nodes) for a tree of depth k: nodes at most what k levels draft (4, 8 at K = 1 -> 4, 5)."""
    topk, nodes = tree
    return topk, min(nodes, 1 + topk + (k - 1) * topk * topk)


def speculation_of(
    draft: Path | None, lookup: tuple[int, int] | None, tree: tuple[int, int] | None = None
) -> tuple[str, dict]:
    """A row's engine name and its LLM options: the draft (as a chain or a tree), n-gram lookup, or both."""
    ngram = {} if lookup is None else {"prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1]}
    if tree is not None:
        topk, nodes = tree
        options = {"draft": draft, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": nodes}
        return f"redline+eagle3{'+ngram' if ngram else ''} tree {topk}x{nodes}", {**options, **ngram}
    if lookup is None:
        return ("redline+eagle3", {"draft": draft}) if draft else ("redline", {})
    if draft:
        return "redline+eagle3+ngram", {"draft": draft, **ngram}
    return "redline+ngram", {"speculative_method": "ngram", **ngram}


def redline_rows(
    draft: Path | None, ks: list[int], s: BenchSettings
) -> list[tuple[int, Path | None, tuple[int, int] | None, tuple[int, int] | None]]:
    """(K, draft, n-gram lookup, tree) of every redline row: plain (K 0), then per K the draft's chain, its
    trees, n-gram lookup, and the draft with n-gram lookup (as a chain and as each tree)."""
    rows = [(0, None, None, None)]
    for k in ks:
        # each tree cut to what k levels draft, once (4x8 and 4x5 at K = 1 are both 4x5)
        trees = list(dict.fromkeys(tree_at(k, t) for t in s.trees)) if draft else []
        rows += [(k, draft, None, None)] if draft else []
        rows += [(k, draft, None, t) for t in trees]
        rows += [(k, None, s.ngram, None)] if s.ngram else []
        rows += [(k, draft, s.ngram, t) for t in [None, *trees]] if draft and s.ngram else []
    return rows


def contenders_of(model_dir: Path, draft: Path | None, ks: list[int], prompts: list[list[int]],
                  s: BenchSettings) -> list[Contender]:  # fmt: skip
    """HF, llama.cpp on each GGUF file, then redline's rows in each mode, in the model's dtype and then in
    each of s.quantizations ("redline int4", "redline+eagle3 int4", ...)."""
    context = max(map(len, prompts)) + s.max_tokens + 16
    contenders: list[Contender] = [HFContender(model_dir, s.dtype)] if s.hf else []
    contenders += [LlamaCppContender(path, context, torch.get_num_threads()) for path in s.gguf_files]
    for compiled in s.modes:
        for quantization in (None, *s.quantizations):
            weights = {} if quantization is None else {"quantization": quantization,
                                                       "quantization_group_size": s.group_size}  # fmt: skip
            for k, row_draft, lookup, tree in redline_rows(draft, ks, s):
                engine, speculation = speculation_of(row_draft, lookup, tree) if k else ("redline", {})
                options = dict(
                    dtype=s.dtype, max_num_seqs=1, max_model_len=context, num_speculative_tokens=k or 3,
                    tensor_parallel_size=s.tensor_parallel_size, enable_expert_parallel=s.expert_parallel,
                    enable_prefix_caching=False,  # every repeat prefills cold, as the other engines do
                    **speculation, **weights,
                )  # fmt: skip
                engine += "" if quantization is None else f" {quantization}"
                contenders.append(
                    RedlineContender(model_dir, engine, k or None, compiled, options, s.tensor_parallel_size)
                )
    return contenders


def summary(m: Measured, prompts: list[list[int]]) -> dict:
    """A row of the results: rates and TTFTs over every completion (repeat after repeat, prompt after
    prompt, so that rows pair up), the last repeat's tokens, and what only its engine measures."""
    c, rates = m.contender, [r.rate for r in m.runs]
    return {
        "engine": c.engine, "compiled": c.compiled, "num_draft_tokens": c.num_draft_tokens,
        "tps_user_median": median(rates), "tps_user_min": min(rates), "tps_user_max": max(rates),
        "ttft_s_median": median(r.ttft_s for r in m.runs), "warmup_s": c.warmup_s,
        "acceptance_length": None, "acceptance_rates": None, "draft_share": None, "rates": rates,
        "tokens": [r.tokens for r in m.runs[-len(prompts):]], **m.row,
    }  # fmt: skip


def model_bytes(model_dir: Path, dtype: str) -> tuple[int, int]:
    """(bytes a decode step reads, bytes of every parameter) of the target in `dtype`."""
    from redline.models.build import load_target

    model = load_target(model_dir, parse_dtype(dtype))
    return weight_bytes_per_token(model), sum(p.numel() * p.element_size() for p in model.parameters())


def roofline(weight_bytes: int, before_gbps: float) -> dict:
    """The bound, at the mean of the read bandwidth measured before the rounds and now, after them."""
    after_gbps = read_bandwidth_gbps()
    bandwidth = (before_gbps + after_gbps) / 2
    return {"bandwidth_gbps": bandwidth, "bandwidth_gbps_before": before_gbps,
            "bandwidth_gbps_after": after_gbps, "weight_bytes": weight_bytes,
            "tps": bandwidth * 1e9 / weight_bytes}  # fmt: skip


def run_bench(model_dir: Path, draft: Path | None, ks: list[int], s: BenchSettings) -> dict:
    if s.data:
        prompts = engine_prompts(Tokenizer.from_dir(model_dir), s.data, s.num_prompts)
    else:
        prompts = held_out_prompts(model_dir, s.num_prompts, s.prompt_len)
    weight_bytes, all_bytes = model_bytes(model_dir, s.dtype)
    contenders = contenders_of(model_dir, draft, ks, prompts, s)
    # tensor-parallel engines run apart: each holds the one process group its ranks share
    together = not s.sequential and s.tensor_parallel_size == 1 and fit_together(contenders, all_bytes)
    before_gbps = read_bandwidth_gbps()
    measured, failures = in_turns(contenders, prompts, s.max_tokens, s.repeats, together)
    bound = roofline(weight_bytes, before_gbps)
    runs = [summary(m, prompts) for m in measured]
    # the first redline plain run, and of each quantization's rows the first plain one in it
    reference = next(r["tokens"] for r in runs if r["engine"] == "redline")
    references = {
        q: next(r["tokens"] for r in runs if r["engine"] == f"redline {q}") for q in s.quantizations
    }
    hf = next((r for r in runs if r["engine"] == "hf"), None)
    for run in runs:
        want = references.get(run.get("quantization"), reference)
        run["tokens_equal_plain"] = run.pop("tokens") == want  # greedy: every engine should agree
        run["x_plain"] = paired_ratio(run, plain_of(runs, run))
        run["x_hf"] = paired_ratio(run, hf) if hf else None
        bytes_per_step = run.get("weight_bytes", bound["weight_bytes"])
        run["roofline_pct"] = 100 * run["tps_user_median"] * bytes_per_step / (bound["bandwidth_gbps"] * 1e9)
    settings = {**s.__dict__, "gguf_files": [str(p) for p in s.gguf_files], "model": str(model_dir),
                "draft": str(draft or ""), "in_turns": together}  # fmt: skip
    return {"runs": runs, "roofline": bound, "settings": settings, "failures": failures}
