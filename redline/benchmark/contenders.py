"""The engines `redline bench` compares, each behind one interface: open it (load, compile), complete a
prompt (greedy, a fixed number of tokens, timed token by token), add what only it measures to its row,
close it. run.py runs them in turns (rounds.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from redline.benchmark import hf, llamacpp
from redline.dtypes import parse_dtype
from redline.engine.llm import LLM
from redline.engine.request import Completion
from redline.models.gguf_reader import GGUFError
from redline.quant.int4 import Int4Linear
from redline.runner.one_slot import fill_slot, release_slot
from redline.sampling import SamplingParams
from redline.speculative.tree import tree_mask
from redline.train.draft import run_acceptance_length


@dataclass
class Timed:
    """One completion: its tokens, time to the first token, decode tokens/s per user ((N - 1) / (t_last -
    t_first)), and redline's Completion (acceptance counts) where the engine is redline."""

    tokens: list[int]
    ttft_s: float
    rate: float
    completion: Completion | None = None


class Contender(Protocol):
    engine: str  # the row's name
    compiled: bool
    num_draft_tokens: int | None
    warmup_s: float  # the first completion's time, after redline's start-up compile (LLM.warmup_s)

    def open(self) -> None: ...
    def complete(self, prompt: list[int], n: int) -> Timed: ...
    def row(self, runs: list[Timed], prompts: list[list[int]]) -> dict: ...  # fields beyond the rates
    def close(self) -> None: ...


@dataclass
class HFContender:
    """HF transformers generate: the reference every speedup is against."""

    model_dir: Path
    dtype: str
    engine: str = "hf"
    compiled: bool = False
    num_draft_tokens: int | None = None
    warmup_s: float = 0.0
    model: torch.nn.Module | None = None

    def open(self) -> None:
        self.model = hf.load_hf(self.model_dir, parse_dtype(self.dtype))

    def complete(self, prompt: list[int], n: int) -> Timed:
        return Timed(*hf.run_hf(self.model, prompt, n))

    def row(self, runs: list[Timed], prompts: list[list[int]]) -> dict:
        return {}

    def close(self) -> None:
        self.model = None


@dataclass
class LlamaCppContender:
    """A GGUF file in llama.cpp, in a child process that lives from open to close (llamacpp.py)."""

    path: Path
    context: int
    threads: int
    engine: str = ""  # "llama.cpp Q4_1": the file's kind by default
    compiled: bool = False
    num_draft_tokens: int | None = None
    warmup_s: float = 0.0
    child: llamacpp.Child | None = None

    def __post_init__(self) -> None:
        if not self.engine:
            try:
                self.engine = f"llama.cpp {llamacpp.file_kind(self.path)}"
            except (GGUFError, ValueError):  # a file redline cannot read: llama.cpp's own error names it
                self.engine = f"llama.cpp {self.path.name}"

    def open(self) -> None:
        self.child = llamacpp.Child(self.path, self.context, self.threads)

    def complete(self, prompt: list[int], n: int) -> Timed:
        return Timed(*self.child.complete(prompt, n))

    def row(self, runs: list[Timed], prompts: list[list[int]]) -> dict:
        return {"weight_bytes": llamacpp.weight_bytes(self.path)}  # its own roofline: the file's bytes

    def close(self) -> None:
        if self.child is not None:
            self.child.close()
            self.child = None


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode step of a dense model reads: every parameter once (a tied
    embedding is read whole as the lm_head), except an untied input embedding, of which one row is read,
    and torch's int4 layers' weights (quant/int4.py: buffers). (An MoE step reads only its routed experts:
    this is an upper bound there.)"""
    int4 = [b for m in model.modules() if isinstance(m, Int4Linear) for b in m.buffers()]
    total = sum(p.numel() * p.element_size() for p in [*model.parameters(), *int4])
    embedding = model.model.embed_tokens.weight
    if embedding is not model.lm_head.weight:
        total -= embedding.numel() * embedding.element_size()
    return total


@dataclass
class RedlineContender:
    """redline at batch 1: plain, or speculating with `options` (run.speculation_of) at K drafts."""

    model_dir: Path
    engine: str
    num_draft_tokens: int | None
    compiled: bool
    options: dict  # LLM's keyword arguments: dtype, lengths, parallelism, speculation
    tensor_parallel_size: int = 1
    warmup_s: float = 0.0
    llm: LLM | None = None

    def open(self) -> None:
        # greedy completions alone: the logits path's steps never run, so they are not compiled either
        self.llm = LLM(self.model_dir, compile=self.compiled, compile_sampling=False, **self.options)
        self.warmup_s = self.llm.warmup_s  # compiling every shape it runs, at start-up

    def complete(self, prompt: list[int], n: int) -> Timed:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        c = self.llm.generate([prompt], params)[0]
        return Timed(c.token_ids, c.ttft_s, c.tokens_per_s, c)

    def row(self, runs: list[Timed], prompts: list[list[int]]) -> dict:
        row = {"tensor_parallel_size": self.tensor_parallel_size}
        if self.options.get("quantization"):  # its own roofline: the quantized weights' bytes
            row |= {"quantization": self.options["quantization"],
                    "weight_bytes": weight_bytes_per_token(self.llm.model)}  # fmt: skip
        k, completions = self.num_draft_tokens, [r.completion for r in runs]
        if not k:
            return row
        steps = sum(c.draft_steps for c in completions)
        row["acceptance_length"] = run_acceptance_length(completions)
        row["acceptance_rates"] = [
            sum(c.draft_steps * (c.acceptance_rates or [0.0] * k)[i] for c in completions) / max(steps, 1)
            for i in range(k)
        ]
        row["draft_step_share"] = steps / max(sum(c.decode_steps for c in completions), 1)
        if self.tensor_parallel_size == 1:  # it times the step's parts on this process's runner alone
            row["draft_share"] = draft_share(self.llm, prompts[0])
        return row

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None


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

    def fastest(*fns) -> list[float]:
        """The fastest of `steps` calls of each, taken in turns: other load on the machine only slows calls
        down, and in turns it falls on both alike (timed one after the other, a busy spell during the
        target's calls alone gave a share of -16%)."""
        times = [[] for _ in fns]
        for fn in fns:
            fn()
        for _ in range(steps):
            for fn, kept_times in zip(fns, times, strict=True):
                start = time.perf_counter()
                fn()
                kept_times.append(time.perf_counter() - start)
        return [min(t) for t in times]

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

    target_time, step_time = fastest(target_only, whole_step)
    share = 1.0 - target_time / step_time
    release_slot(runner)
    return share
