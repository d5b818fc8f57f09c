"""`redline quantize`: an FP8 copy of a checkpoint in the compressed-tensors layout, streamed.

One tensor at a time is read (safetensors or .bin), quantized if it is a decoder linear's or the experts'
weight (e4m3, per output channel; the weight and its `_scale` under the same key + "_scale"), copied
unchanged otherwise (embeddings, norms, lm_head, router, vision tower), and written into the current
safetensors shard; a full shard goes to disk. Memory holds one shard and one tensor, never the model.
The layout follows the source: fused Llama 4 experts stay fused (gate_up_proj + gate_up_proj_scale
[E, 1, 2I], down_proj + down_proj_scale [E, H, 1]), per-expert ones stay per expert.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from redline.config import ConfigError, ModelConfig
from redline.models.build import checkpoint_key_to_module_key, module_key_to_checkpoint_key, skeleton
from redline.models.loader import Part, check_checkpoint
from redline.models.quantize import HIGH_PRECISION, quantized_weights
from redline.models.shards import DEFAULT_SHARD_BYTES, ShardWriter
from redline.models.tensor_files import checkpoint_files, open_tensor_file
from redline.quant.fp8 import Kind, quantize_weight
from redline.quant.scheme import Fp8Scheme, compressed_tensors_config, fp8_scheme

COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def quantize_checkpoint(
    model_dir: str | Path, out: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> dict[str, int]:
    """FP8 copy of a high-precision checkpoint, in shards of at most max_shard_bytes (plus one tensor's
    size when a single tensor is larger). Returns FP8 and total parameter counts of the language model."""
    model_dir, out = Path(model_dir), Path(out)
    config = ModelConfig.from_dir(model_dir)
    if fp8_scheme(config.raw, str(model_dir / "config.json")) is not None:
        raise ConfigError(f"{model_dir / 'config.json'}: the checkpoint is quantized already")
    rename, model = checkpoint_key_to_module_key(config), skeleton(model_dir)
    optional = ["lm_head.weight"] if config.tie_word_embeddings else []
    check_checkpoint(model, model_dir, rename=rename, optional=optional)
    weights = quantized_weights(model, Fp8Scheme(tuple(HIGH_PRECISION)))
    by_file: dict[Path, list[str]] = {}
    for key, path in checkpoint_files(model_dir).items():
        by_file.setdefault(path, []).append(key)
    writer = ShardWriter(out, max_shard_bytes)
    counts = {"fp8_parameters": 0, "parameters": 0}
    for path, keys in by_file.items():
        with open_tensor_file(path) as file:
            for key in keys:
                tensor, target = file.read(key), rename(key)
                kind = _kind(target, weights)
                if kind is None:
                    writer.add(key, tensor)
                else:
                    q, scale = quantize_weight(tensor, kind)
                    writer.add(key, q)
                    writer.add(f"{key}_scale", scale)
                    counts["fp8_parameters"] += q.numel()
                counts["parameters"] += tensor.numel() if target is not None else 0
                del tensor
    writer.finish()
    raw = config.raw | {"quantization_config": compressed_tensors_config(_ignore(config))}
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for name in COPIED:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return counts


def _kind(target: str | Part | None, weights: dict[str, Kind]) -> Kind | None:
    """How a checkpoint tensor is quantized, or None to copy it. A per-expert weight (a Part of a fused
    expert tensor) is an nn.Linear weight [out, in], quantized as one."""
    if isinstance(target, Part):
        return "linear" if target.module_key in weights else None
    return weights.get(target) if target is not None else None


def _ignore(config: ModelConfig) -> list[str]:
    """HIGH_PRECISION in the checkpoint's names, so other readers of compressed-tensors match them."""
    ignore = [p if p.startswith("re:") else module_key_to_checkpoint_key(config, p) for p in HIGH_PRECISION]
    if config.weight_prefix:  # a multimodal Llama 4: its vision tower stays as it was
        ignore += ["re:vision_model.*", "re:multi_modal_projector.*"]
    return ignore
