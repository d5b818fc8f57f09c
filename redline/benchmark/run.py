"""`redline bench`: HF generate, redline plain decode and redline + EAGLE-3 for each K, in one process, on
the same weights, prompts, dtype and thread count; batch 1, greedy, fixed-length completions. With
`ngram`, n-gram lookup rows too: redline+ngram for each K, and beside a draft redline+eagle3+ngram; with
`trees`, the draft as each tree of depth K too (redline+eagle3 tree TOPKxNODES).

Prompts: windows of `prompt_len` tokens cut from the stdlib held-out files, or with `data` the first
whole prompts of a held-out set (HumanEval raw; ShareGPT's first user turn in the chat template).
Per configuration, every prompt is completed `repeats` times after one warm-up completion (which also
holds the compile, reported as warmup_s). tokens/s per user is the decode rate of one completion,
(N - 1) / (t_last - t_first); median, min and max are over all prompts x repeats.

redline runs eager, compiled, or both (`modes`); with a GGUF model and llama-cpp-python installed,
llama.cpp runs the GGUF file and an F16 copy of its dequantized weights (llamacpp.py).

Roofline: a batch-1 decode step reads every weight of the target once, so no engine can produce more
than bandwidth / weight bytes tokens per step-time; the bandwidth is measured in the same run
(machine.read_bandwidth_gbps) and each run's roofline_pct is its median tokens/s against that bound
(speculation can pass 100%: it produces several tokens per read of the weights). A llama.cpp row's bound
is its own file's tensor bytes.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import torch

from redline.benchmark import hf, llamacpp
from redline.benchmark.machine import read_bandwidth_gbps
from redline.benchmark.prompts import engine_prompts
from redline.dtypes import parse_dtype
from redline.engine.llm import LLM
from redline.engine.request import Completion
from redline.runner.one_slot import fill_slot, release_slot
from redline.sampling import SamplingParams
from redline.speculative.tree import tree_mask
from redline.tokenizer import Tokenizer
from redline.train.draft import held_out_prompts, run_acceptance_length


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


def _summary(engine: str, k: int | None, rates: list[float], ttfts: list[float], warmup_s: float) -> dict:
    return {"engine": engine, "compiled": False, "num_draft_tokens": k, "tps_user_median": median(rates),
            "tps_user_min": min(rates), "tps_user_max": max(rates), "ttft_s_median": median(ttfts),
            "warmup_s": warmup_s, "acceptance_length": None, "acceptance_rates": None,
            "draft_share": None}  # fmt: skip


def bench_hf(model_dir: Path, prompts: list[list[int]], s: BenchSettings) -> tuple[dict, list[list[int]]]:
    model = hf.load_hf(model_dir, parse_dtype(s.dtype))
    r = llamacpp.timed_runs(lambda prompt, n: hf.run_hf(model, prompt, n), prompts, s.max_tokens, s.repeats)
    return _summary("hf", None, r["rates"], r["ttfts"], r["warmup_s"]), r["outputs"]


def bench_llama_cpp(path: Path, prompts: list[list[int]], s: BenchSettings) -> tuple[dict, list[list[int]]]:
    r = llamacpp.bench_in_child(path, prompts, s.max_tokens, s.repeats, torch.get_num_threads())
    engine = f"llama.cpp {llamacpp.file_kind(path)}"
    result = _summary(engine, None, r["rates"], r["ttfts"], r["warmup_s"])
    result["weight_bytes"] = llamacpp.weight_bytes(path)  # its own roofline, in the file's quantization
    return result, r["outputs"]


def tree_at(k: int, tree: tuple[int, int]) -> tuple[int, int]:
    """(topk, nodes) for a tree of depth k: nodes at most what k levels draft (4, 8 at K = 1 -> 4, 5)."""
    topk, nodes = tree
    return topk, min(nodes, 1 + topk + (k - 1) * topk * topk)


def speculation_of(
    draft: Path | None, lookup: tuple[int, int] | None, tree: tuple[int, int] | None = None
) -> tuple[str, dict]:
    """A row's engine name and its LLM options: the draft (as a chain or a tree), n-gram lookup, or both."""
    if tree is not None:
        topk, nodes = tree
        options = {"draft": draft, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": nodes}
        return f"redline+eagle3 tree {topk}x{nodes}", options
    if lookup is None:
        return ("redline+eagle3", {"draft": draft}) if draft else ("redline", {})
    ngram = {"prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1]}
    if draft:
        return "redline+eagle3+ngram", {"draft": draft, **ngram}
    return "redline+ngram", {"speculative_method": "ngram", **ngram}


def bench_redline(
    model_dir: Path,
    draft: Path | None,
    k: int,
    prompts: list[list[int]],
    s: BenchSettings,
    compiled: bool,
    lookup: tuple[int, int] | None = None,  # n-gram lookup (min, max)
    tree: tuple[int, int] | None = None,  # a draft tree: topk, num_draft_tokens
) -> tuple[dict, list[list[int]]]:
    engine, speculation = speculation_of(draft, lookup, tree) if k else ("redline", {})
    llm = LLM(
        model_dir, dtype=s.dtype, max_num_seqs=1, max_model_len=max(map(len, prompts)) + s.max_tokens + 16,
        num_speculative_tokens=k or 3, compile=compiled, **speculation,
        tensor_parallel_size=s.tensor_parallel_size, enable_expert_parallel=s.expert_parallel,
        enable_prefix_caching=False,  # every repeat prefills cold, as the other engines do: TTFTs compare
    )  # fmt: skip
    params = SamplingParams(max_tokens=s.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompts[0]], params)
    warmup = llm.warmup_s + time.perf_counter() - start  # compiling every shape at start-up, then one run
    completions: list[Completion] = []
    for _ in range(s.repeats):
        for prompt in prompts:  # one at a time: batch 1, per-user latency
            completions.append(llm.generate([prompt], params)[0])
    result = _summary(
        engine, k or None, [c.tokens_per_s for c in completions], [c.ttft_s for c in completions], warmup
    )
    result["compiled"] = compiled
    if k:
        steps = sum(c.draft_steps for c in completions)
        result["acceptance_length"] = run_acceptance_length(completions)
        result["acceptance_rates"] = [
            sum(c.draft_steps * (c.acceptance_rates or [0.0] * k)[i] for c in completions) / max(steps, 1)
            for i in range(k)
        ]
        result["draft_step_share"] = steps / max(sum(c.decode_steps for c in completions), 1)
        if s.tensor_parallel_size == 1:  # it times the step's parts on this process's runner alone
            result["draft_share"] = draft_share(llm, prompts[0])
    result["tensor_parallel_size"] = s.tensor_parallel_size
    llm.close()
    return result, [c.token_ids for c in completions[-len(prompts) :]]


@torch.inference_mode()
def draft_share(llm: LLM, prompt: list[int], steps: int = 10) -> float:
    """The share of an eager decode step not spent in the target's forward over its K + 1 tokens, or its
    tree's N (the draft's proposals plus verification): 1 - (target forward) / (whole step), both at the
    same KV bucket, on the runner of an idle engine: the prompt prefilled into slot 0 over the pool's
    first blocks."""
    runner, shapes = llm.runner, llm.runner.shapes
    fill_slot(runner, prompt, positions=len(prompt) + shapes.lookahead)
    kv_len = shapes.kv_len_for(len(prompt) + 1)
    state = runner.state
    positions, tree = state.pos[:1, None] + torch.arange(state.pending.shape[1]), None
    if shapes.tree is not None and state.parents is not None:
        positions, tree = tree_mask(state.parents[:1], state.pos[:1], shapes.tree.steps)

    def timed(fn) -> float:  # the fastest of `steps` calls: other load on the machine only slows calls down
        fn()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def target_only() -> None:
        tables = runner.cache.tables(0, 1)
        hidden, _ = runner.model(state.pending[:1], positions, runner.cache.layers, tables, kv_len, tree)
        runner.model.logits(hidden)

    # the step advances the slot (and redrafts its tree), so give it its own copy of the state each time
    stepped = [t for t in (state.pending, state.pos, state.parents) if t is not None]
    kept = [t.clone() for t in stepped]

    def whole_step() -> None:
        for t, copy in zip(stepped, kept, strict=True):
            t.copy_(copy)
        runner.step(1, kv_len, False)

    share = 1.0 - timed(target_only) / timed(whole_step)
    release_slot(runner)
    return share


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode step of a dense model reads: every parameter once (a tied
    embedding is read whole as the lm_head), except an untied input embedding, of which one row is read.
    (An MoE step reads only its routed experts: this is an upper bound there.)"""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    if embedding is not model.lm_head.weight:
        total -= embedding.numel() * embedding.element_size()
    return total


def roofline(model_dir: Path, dtype: str) -> dict:
    from redline.models.build import load_target

    weight_bytes = weight_bytes_per_token(load_target(model_dir, parse_dtype(dtype)))
    bandwidth = read_bandwidth_gbps()
    return {"bandwidth_gbps": bandwidth, "weight_bytes": weight_bytes, "tps": bandwidth * 1e9 / weight_bytes}


def run_bench(model_dir: Path, draft: Path | None, ks: list[int], s: BenchSettings) -> dict:
    if s.data:
        prompts = engine_prompts(Tokenizer.from_dir(model_dir), s.data, s.num_prompts)
    else:
        prompts = held_out_prompts(model_dir, s.num_prompts, s.prompt_len)
    measured = [bench_hf(model_dir, prompts, s)] if s.hf else []  # (run, its outputs) per configuration
    failures = []
    for path in s.gguf_files:
        try:
            measured.append(bench_llama_cpp(path, prompts, s))
        except RuntimeError as e:  # a peer that fails is reported, and the benchmark goes on
            print(f"[redline] {e}", file=sys.stderr)
            failures.append(str(e))
    reference = None
    Row = tuple[int, Path | None, tuple[int, int] | None, tuple[int, int] | None]  # K, draft, lookup, tree
    rows: list[Row] = [(0, None, None, None)]
    for k in ks:
        rows += [(k, draft, None, None)] if draft else []
        # each tree cut to what k levels draft, once (4x8 and 4x5 at K = 1 are both 4x5)
        rows += [(k, draft, None, t) for t in dict.fromkeys(tree_at(k, t) for t in s.trees)] if draft else []
        rows += [(k, None, s.ngram, None)] if s.ngram else []
        rows += [(k, draft, s.ngram, None)] if draft and s.ngram else []
    for compiled in s.modes:
        for k, row_draft, lookup, tree in rows:
            measured.append(bench_redline(model_dir, row_draft, k, prompts, s, compiled, lookup, tree))
            reference = reference or measured[-1][1]  # the first redline plain run
    bound = roofline(model_dir, s.dtype)
    runs = [run for run, _ in measured]
    for run, tokens in measured:
        run["tokens_equal_plain"] = tokens == reference  # greedy: every engine should agree
        bytes_per_step = run.get("weight_bytes", bound["weight_bytes"])
        run["roofline_pct"] = 100 * run["tps_user_median"] * bytes_per_step / (bound["bandwidth_gbps"] * 1e9)
    settings = {**s.__dict__, "gguf_files": [str(p) for p in s.gguf_files], "model": str(model_dir),
                "draft": str(draft or "")}  # fmt: skip
    return {"runs": runs, "roofline": bound, "settings": settings, "failures": failures}
