"""Build a target model from a Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from redline.config import ModelConfig
from redline.models.llama import LlamaForCausalLM
from redline.models.loader import load_weights
from redline.quant.convert import HIGH_PRECISION, to_fp8
from redline.quant.fp8 import scaled_mm_available
from redline.quant.scheme import Fp8Scheme, fp8_scheme

# Multimodal Llama 4 checkpoints hold the vision tower and projector beside the language model.
_SKIPPED_PREFIXES = ("vision_model.", "multi_modal_projector.")


def checkpoint_key_to_module_key(config: ModelConfig):
    """language_model.model.layers.1.feed_forward.router.weight -> model.layers.1.mlp.router.weight"""
    prefix = config.weight_prefix

    def rename(key: str) -> str | None:
        if key.startswith(_SKIPPED_PREFIXES):
            return None
        if prefix:
            if not key.startswith(prefix):
                return key  # reported as unexpected by the loader
            key = key[len(prefix) :]
        return key.replace(".feed_forward.", ".mlp.")

    return rename


def module_key_to_checkpoint_key(config: ModelConfig, key: str) -> str:
    """The inverse of checkpoint_key_to_module_key (for writing checkpoints)."""
    if config.family == "llama4":
        key = key.replace(".mlp.", ".feed_forward.")
    return config.weight_prefix + key


def load_target(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """quantization "fp8" quantizes a high-precision checkpoint on load; FP8 checkpoints load as FP8
    whatever it says."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"unknown quantization {quantization!r}; choose fp8")
    config = ModelConfig.from_dir(model_dir)
    scheme = fp8_scheme(config.raw, str(Path(model_dir) / "config.json"))
    scaled_mm = scaled_mm_available(torch.device(device))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        if scheme is not None:
            to_fp8(model, scheme, scaled_mm)
    optional = ["lm_head.weight"] if config.tie_word_embeddings else []
    load_weights(
        model,
        model_dir,
        dtype=dtype,
        device=device,
        rename=checkpoint_key_to_module_key(config),
        optional=optional,
    )
    model.tie_weights()
    if scheme is None and quantization == "fp8":
        with torch.no_grad():
            to_fp8(model, Fp8Scheme(tuple(HIGH_PRECISION)), scaled_mm)
    model.model.rotary.materialize(torch.device(device))
    return model.eval()
