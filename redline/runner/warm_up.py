"""Compiling and capturing every shape a runner can meet, before the first request (without
compile_sampling, the argmax steps': the logits path's run eagerly, ModelRunner.built_step_keys).

- the prefill: one graph with the batch, chunk length and keys dynamic, plus one per side of a length
  branch in the model (a Llama 4 MoE layer's few-token path): prefill_shapes visits them all;
- the decode step: compiled, one graph per (rows, sampling, k), run once at the smallest kv bucket (kv_len
  is a dynamic dimension); captured as CUDA graphs, one per (rows, kv_len, sampling, k) key;
- one real prompt through the eager parts (the draft's priming pass: on CUDA its Triton kernels compile
  on first use).

Then every stage freezes: a shape outside the set raises (the step) or runs eagerly with a warning (the
prefill) instead of compiling while serving. Free slots compute at position 0 in the scratch block and
never advance; the prompt's slot is released again, and the KV entries written are rewritten before they
are read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from redline.kernels.paged_kv import BLOCK
from redline.runner.compiled_prefill import prefill_shapes
from redline.runner.model_runner import ModelRunner
from redline.runner.one_slot import fill_slot, release_slot

WARM_UP_PROMPT = 20  # tokens of the eager prompt run


def needs_warm_up(runner: ModelRunner) -> bool:
    return any(s is not None for s in (runner.compiled_prefill, runner.compiled_step, runner.graphed_step))


def step_keys_to_run(runner: ModelRunner) -> list[tuple[int, int, bool, int]]:
    """The step keys warm-up runs, of those the runner builds (ModelRunner.built_step_keys): all of them for
    CUDA graphs (one graph per key), else one per (rows, sampling, k) at the smallest kv bucket: a compiled
    step has one graph for every kv_len."""
    keys = runner.built_step_keys()
    if runner.graphed_step is not None:
        return keys
    smallest_kv: dict[tuple[int, bool, int], int] = {}
    for rows, kv_len, sampling, k in keys:
        smallest_kv.setdefault((rows, sampling, k), kv_len)
    return [(rows, kv_len, sampling, k) for (rows, sampling, k), kv_len in smallest_kv.items()]


@torch.inference_mode()
def warm_up(
    runner: ModelRunner,
    progress: bool = True,
    prompt: bool = True,
    go_on: Callable[[], bool] | None = None,
    steps: bool = True,
    prefill: bool = True,
) -> bool:
    """prompt=False leaves out the eager prompt run, which writes the pool's first blocks: a runner that
    shares its KV pool with one serving requests (runner/background_compile.py) touches only the scratch
    block. steps / prefill: which stages to compile (and then freeze). go_on: called before each shape (it
    may wait for its turn); once it says False, the warm-up returns False, unfinished (not frozen)."""
    shapes = runner.shapes
    work: list[tuple[str, Callable[[], object]]] = []
    if prefill and runner.compiled_prefill is not None:
        for rows, n in prefill_shapes(shapes.cache_len, runner.model.token_count_branches()):
            if rows <= shapes.slots:  # the batches a prefill can have
                work.append((f"prefill {rows}x{n}", lambda rows=rows, n=n: _prefill(runner, rows, n)))
    if steps:
        for key in step_keys_to_run(runner):
            name = f"step {key[0]}x{key[1]}" + (f" k={key[3]}" if len(runner.shapes.variants) > 1 else "")
            work.append((name, lambda key=key: runner.run_step(*key)))
    if prompt:
        work.append(("prompt", lambda: _prompt(runner)))
    with tqdm(work, desc="compiling" if runner.compiled_step else "capturing", disable=not progress) as bar:
        for name, run in bar:
            if go_on is not None and not go_on():
                return False
            bar.set_postfix_str(name)
            run()
    stages = []
    if steps:
        stages += [runner.compiled_step, runner.graphed_step]
    if prefill:
        stages.append(runner.compiled_prefill)
    for stage in stages:
        if stage is not None:
            stage.freeze()
    return True


def _prefill(runner: ModelRunner, rows: int, length: int) -> None:
    """One compiled prefill of `rows` x `length` tokens whose every write lands in the scratch block (the
    pool's other blocks may hold a serving runner's keys)."""
    assert runner.compiled_prefill is not None
    device, cache = runner.device, runner.cache
    tokens = torch.zeros((rows, length), dtype=torch.int64, device=device)
    positions = torch.arange(length, device=device).expand(rows, -1).contiguous()
    tables = torch.full((rows, cache.table.shape[1]), cache.scratch_block, dtype=torch.int32, device=device)
    runner.compiled_prefill.compile_shape(
        tokens, positions, tables, min(length + BLOCK, runner.shapes.cache_len)
    )


def _prompt(runner: ModelRunner) -> None:
    """A whole prompt in slot 0 over the pool's first blocks (nothing holds them yet), then released."""
    shapes = runner.shapes
    prompt = (0,) * max(1, min(WARM_UP_PROMPT, shapes.max_len - 1))
    fill_slot(runner, prompt, positions=len(prompt) + shapes.lookahead)
    release_slot(runner)
