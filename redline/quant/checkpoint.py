"""`redline quantize`: an FP8 copy of a checkpoint in the compressed-tensors layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from redline.config import ModelConfig
from redline.models.build import load_target, module_key_to_checkpoint_key
from redline.models.loader import save_weights
from redline.quant.convert import HIGH_PRECISION, to_fp8
from redline.quant.fp8 import FP8
from redline.quant.scheme import Fp8Scheme, compressed_tensors_config

COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def quantize_checkpoint(model_dir: Path, out: Path) -> dict[str, int]:
    """FP8 copy of a checkpoint: weights quantized from fp32, other tensors in the config's dtype."""
    config = ModelConfig.from_dir(model_dir)
    model = load_target(model_dir, torch.float32)
    to_fp8(model, Fp8Scheme(tuple(HIGH_PRECISION)), scaled_mm=False)
    keep_dtype = _config_dtype(config.raw)
    state = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if tensor.is_floating_point() and tensor.dtype != FP8 and not key.endswith("_scale"):
            tensor = tensor.to(keep_dtype)
        state[module_key_to_checkpoint_key(config, key)] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_weights(state, out)
    raw = dict(config.raw)
    raw["quantization_config"] = compressed_tensors_config(HIGH_PRECISION)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for name in COPIED:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    fp8 = sum(t.numel() for t in state.values() if t.dtype == FP8)
    return {
        "fp8_parameters": fp8,
        "parameters": sum(t.numel() for k, t in state.items() if not k.endswith("_scale")),
    }


def _config_dtype(raw: dict) -> torch.dtype:
    name = raw.get("torch_dtype") or raw.get("dtype") or (raw.get("text_config") or {}).get("torch_dtype")
    return {"float32": torch.float32, "float16": torch.float16}.get(name, torch.bfloat16)
