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
from redline.parallel.group import TensorParallel
from redline.runner.model_runner import ModelRunner
from redline.runner.plan import Shapes


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
    return Shapes(config.scheduler.slots, context_len(config, model), config.num_draft_tokens)


def backends_of(config: EngineConfig, device: torch.device) -> Backends:
    load = config.load
    compiled = compiles(config, device)
    fp8 = fp8_weights(load.model, "fp8" if load.dtype == "fp8" else load.quantization)
    return Backends.choose(device, load.torch_dtype, compiled, config.compilation.pdl, fp8)


def build_runner(config: EngineConfig, tp: TensorParallel, device: str | None = None) -> ModelRunner:
    """This rank's runner; device overrides config's (rank r of a CUDA group: cuda:r)."""
    load, speculative = config.load, config.speculative
    where = torch.device(device or load.device)
    dtype = load.torch_dtype
    backends = backends_of(config, where)
    if speculative.model is not None:
        model, draft = load_with_draft(load.model, speculative.model, dtype, where, load.quantization, tp,
                                       backends)  # fmt: skip
    else:
        model, draft = load_target(load.model, dtype, where, load.quantization, tp, backends), None
    cache, shapes = config.cache, shapes_of(config, ModelConfig.from_dir(load.model))
    return ModelRunner(
        model, shapes, draft, compiles(config, where), config.compilation.cuda_graphs,
        cache.torch_dtype(dtype), cache.kv_cache_memory_bytes, cache.gpu_memory_utilization,
    )  # fmt: skip
