"""Where a model comes from, in one place: a checkpoint directory as it is, a Hugging Face Hub id's
snapshot (models/hub.py: fetched only when an id is given), or a llama .gguf file's import (models/gguf.py:
made once, cached). Every entry point goes through here: LLM (via `resolve`), `redline info`, `bench`,
`train-draft` and `eval`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from redline.dtypes import DTYPES, parse_dtype
from redline.engine_config import EngineConfig
from redline.models import hub


def checkpoint_dtype(model_dir: Path) -> str:
    """dtype "auto": the checkpoint's own (config.json's torch_dtype, or dtype as transformers 5 writes it),
    bfloat16 when it names none or is not a directory (a .gguf file)."""
    path = model_dir / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    return name if name in DTYPES else "bfloat16"


def local_model(
    model: str | Path, revision: str | None = None, dtype: torch.dtype = torch.bfloat16, progress: bool = True
) -> Path:
    """The checkpoint directory of `model`: itself, a hub id's snapshot at `revision`, or a .gguf file's
    import for running in `dtype` (gguf.import_dtype). FileNotFoundError names what is missing."""
    path = hub.resolve(model, revision)
    if path.suffix == ".gguf":
        from redline.models.gguf import gguf_model_dir, import_dtype

        path = gguf_model_dir(path, import_dtype(dtype), progress=progress)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    return path


def resolve(config: EngineConfig, progress: bool = True) -> EngineConfig:
    """The config with local directories for the model and the draft, and a concrete dtype: "auto" is the
    checkpoint's, unset the device's fast one (engine_config.fast_dtype), "fp8" is bfloat16 activations
    with FP8 weights (quantization "fp8"). Also checks that a CUDA device exists when one is asked for."""
    load, speculative = config.load, config.speculative
    if load.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {load.device!r} requested but CUDA is not available")
    dtype, quantization = load.given_or_fast_dtype, load.quantization
    if dtype == "fp8":
        dtype, quantization = "bfloat16", "fp8"
    found = hub.resolve(load.model, load.revision)
    if dtype == "auto":
        dtype = checkpoint_dtype(found)
    model_dir = local_model(found, dtype=parse_dtype(dtype), progress=progress)
    load = dataclasses.replace(load, model=str(model_dir), dtype=dtype, quantization=quantization)
    if speculative.model is not None:
        speculative = dataclasses.replace(speculative, model=str(local_model(speculative.model)))
    return dataclasses.replace(config, load=load, speculative=speculative)
