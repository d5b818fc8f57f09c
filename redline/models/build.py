"""Build a target model from a Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from redline.config import ModelConfig
from redline.models.llama import LlamaForCausalLM
from redline.models.loader import load_weights

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


def load_target(
    model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
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
    model.model.rotary.materialize(torch.device(device))
    return model.eval()
