"""One rank's runner from a resolved EngineConfig (models/source.py): the kernels chosen for its device,
dtype and compile mode (layers/backends.py), the target built with the draft's aux layers, the draft, the
shapes every step runs at, and the KV pool.
"""

from __future__ import annotations

import os

import torch

from redline.config import ModelConfig
from redline.engine_config import DEFAULT_CONTEXT, EngineConfig
from redline.layers.backends import Backends
from redline.models.build import fp8_weights, load_target, load_with_draft
from redline.models.eagle3 import Eagle3Draft
from redline.models.huge_pages import move_to_huge_pages
from redline.models.llama import LlamaForCausalLM
from redline.parallel.group import SINGLE, TensorParallel
from redline.runner.background_compile import BackgroundCompile
from redline.runner.model_runner import ModelRunner
from redline.runner.plan import Shapes
from redline.speculative.ngram import NgramRange


def compiles(config: EngineConfig, device: torch.device) -> bool:
    """compile: as given; by default on CPU, where it is the fast path (3-4x eager decode), unless the
    environment sets REDLINE_COMPILE=0 (the test suite does, so that only the tests that ask compile);
    CUDA captures every step as a CUDA graph instead."""
    if config.compilation.compile is not None:
        return config.compilation.compile
    return device.type == "cpu" and os.environ.get("REDLINE_COMPILE", "1") != "0"


def context_len(config: EngineConfig, model: ModelConfig) -> int:
    """Prompt + output tokens of one request: max_model_len, or the model's own at most DEFAULT_CONTEXT;
    never past the model's positions."""
    return min(config.scheduler.max_model_len or DEFAULT_CONTEXT, model.max_position)


def shapes_of(config: EngineConfig, model: ModelConfig) -> Shapes:
    lookup = config.speculative.lookup if config.speculation else None
    ngram = None if lookup is None else NgramRange(*lookup)
    tree = config.speculative.tree if config.speculation else None
    adaptive = config.speculative.adaptive_draft_length
    return Shapes(
        config.scheduler.slots, context_len(config, model), config.num_draft_tokens, ngram, adaptive, tree
    )


def backends_of(config: EngineConfig, device: torch.device) -> Backends:
    load = config.load
    compiled = compiles(config, device)
    fp8 = fp8_weights(load.model, "fp8" if load.dtype == "fp8" else load.quantization)
    return Backends.choose(device, load.torch_dtype, compiled, config.compilation.pdl, fp8)


def build_models(
    config: EngineConfig, tp: TensorParallel, where: torch.device
) -> tuple[LlamaForCausalLM, Eagle3Draft | None]:
    """The target and the draft (or None) on `where`, with the kernels of the config's compile mode; on a
    CPU, their weights on huge pages (models/huge_pages.py)."""
    load, speculative = config.load, config.speculative
    dtype, backends = load.torch_dtype, backends_of(config, where)
    draft = None
    if speculative.model is not None:
        model, draft = load_with_draft(
            load.model, speculative.model, dtype, where, load.quantization, tp, backends, load.group_size
        )
    else:
        model = load_target(
            load.model, dtype, where, load.quantization, tp, backends, group_size=load.group_size
        )
    if where.type == "cpu":
        move_to_huge_pages(model, draft)
    return model, draft


def runner_of(
    config: EngineConfig,
    model: LlamaForCausalLM,
    draft: Eagle3Draft | None,
    compile: bool,
    kv_of: ModelRunner | None = None,
) -> ModelRunner:
    cache, shapes = config.cache, shapes_of(config, ModelConfig.from_dir(config.load.model))
    kv_dtype = cache.torch_dtype(config.load.torch_dtype)
    compilation = config.compilation
    return ModelRunner(
        model, shapes, draft, compile, compilation.cuda_graphs, kv_dtype, cache.kv_cache_memory_bytes,
        cache.gpu_memory_utilization, kv_of, compilation.compile_sampling,
    )  # fmt: skip


def build_runner(config: EngineConfig, tp: TensorParallel, device: str | None = None) -> ModelRunner:
    """This rank's runner; device overrides config's (rank r of a CUDA group: cuda:r)."""
    where = torch.device(device or config.load.device)
    model, draft = build_models(config, tp, where)
    return runner_of(config, model, draft, compiles(config, where))


def build_single(config: EngineConfig, progress: bool = True) -> ModelRunner | BackgroundCompile:
    """The runner of a one-process engine; when it compiles in the background (EngineConfig's
    compiles_in_background), an eager runner that switches to its compiled twin once that is ready."""
    where = torch.device(config.load.device)
    if not config.compiles_in_background(compiles(config, where)):
        return build_runner(config, SINGLE)
    model, draft = build_models(config, SINGLE, where)
    eager = runner_of(config, model, draft, compile=False)
    return BackgroundCompile(eager, lambda: runner_of(config, model, draft, True, kv_of=eager), progress)
