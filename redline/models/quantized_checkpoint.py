"""`redline quantize`: a quantized copy of a checkpoint in the compressed-tensors layout, streamed.

One tensor at a time is read (safetensors or .bin), quantized if it is a decoder linear's weight (or, in
FP8, the experts'), copied unchanged otherwise (embeddings, norms, lm_head, router, vision tower), and
written into the current safetensors shard; a full shard goes to disk. Memory holds one shard and one
tensor, never the model.
- fp8 (`float-quantized`): e4m3 per output channel, the weight and its `_scale` under the same key +
  "_scale". The layout follows the source: fused Llama 4 experts stay fused (gate_up_proj +
  gate_up_proj_scale [E, 1, 2I], down_proj + down_proj_scale [E, H, 1]), per-expert ones per expert.
- int4 / int8 (`pack-quantized`, llm-compressor's W4A16_ASYM / W8A16): codes rounded to nearest
  (quant/int_packing.rounded_codes; int4 in groups of 128 by default with zero points, int8 symmetric
  per output channel) packed 8 or 4 to an int32 along each row: `weight_packed` [N, K bits / 32],
  `weight_scale` [N, groups] in the weight's dtype, `weight_shape` [2], int4's `weight_zero_point`
  [N bits / 32, groups] (packed along N). Experts stay as they are.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from redline.config import ConfigError, ModelConfig
from redline.kernels.quantized_layout import check_shape
from redline.models.build import checkpoint_key_to_module_key, module_key_to_checkpoint_key, skeleton
from redline.models.loader import Part, check_checkpoint
from redline.models.quantize import HIGH_PRECISION, quantized_weights
from redline.models.shards import DEFAULT_SHARD_BYTES, ShardWriter
from redline.models.tensor_files import checkpoint_files, open_tensor_file
from redline.quant.fp8 import Kind, quantize_weight
from redline.quant.int_packing import pack_int32, rounded_codes
from redline.quant.int_scheme import WRITTEN_GROUP, WRITTEN_SYMMETRIC, int_scheme, pack_quantized_config
from redline.quant.scheme import Fp8Scheme, compressed_tensors_config, fp8_scheme

COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


SCHEMES = ("fp8", "int4", "int8")


def quantize_checkpoint(
    model_dir: str | Path,
    out: str | Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    scheme: str = "fp8",
    group: int | None = None,  # int4 / int8: weights a scale covers (None: WRITTEN_GROUP's default)
) -> dict[str, int]:
    """A copy of a high-precision checkpoint quantized by `scheme` (SCHEMES), in shards of at most
    max_shard_bytes (plus one tensor's size when a single tensor is larger). Returns quantized and total
    parameter counts of the language model."""
    model_dir, out = Path(model_dir), Path(out)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    config, source = ModelConfig.from_dir(model_dir), str(model_dir / "config.json")
    if fp8_scheme(config.raw, source) is not None or int_scheme(config.raw, source) is not None:
        raise ConfigError(f"{model_dir / 'config.json'}: the checkpoint is quantized already")
    bits = None if scheme == "fp8" else int(scheme[3:])
    if bits is None and group is not None:
        raise ValueError("a group size applies to the int4 and int8 schemes (fp8 scales per output channel)")
    rename, model = checkpoint_key_to_module_key(config), skeleton(model_dir)
    optional = ["lm_head.weight"] if config.tie_word_embeddings else []
    check_checkpoint(model, model_dir, rename=rename, optional=optional)
    weights = quantized_weights(model, Fp8Scheme(tuple(HIGH_PRECISION)), experts=bits is None)
    if bits is not None:
        group = _group(model, list(weights), bits, group)
    by_file: dict[Path, list[str]] = {}
    for key, path in checkpoint_files(model_dir).items():
        by_file.setdefault(path, []).append(key)
    writer = ShardWriter(out, max_shard_bytes)
    counts = {"quantized_parameters": 0, "parameters": 0}
    for path, keys in by_file.items():
        with open_tensor_file(path) as file:
            for key in keys:
                tensor, target = file.read(key), rename(key)
                kind = _kind(target, weights)
                if kind is None:
                    writer.add(key, tensor)
                elif bits is None:
                    q, scale = quantize_weight(tensor, kind)
                    writer.add(key, q)
                    writer.add(f"{key}_scale", scale)
                else:
                    for name, value in pack_quantized(tensor, bits, group, WRITTEN_SYMMETRIC[bits]).items():
                        writer.add(f"{key.removesuffix('.weight')}.{name}", value)
                counts["quantized_parameters"] += tensor.numel() if kind is not None else 0
                counts["parameters"] += tensor.numel() if target is not None else 0
                del tensor
    writer.finish()
    if bits is None:
        raw = config.raw | {"quantization_config": compressed_tensors_config(_ignore(config, False))}
    else:
        quantization = pack_quantized_config(bits, group, WRITTEN_SYMMETRIC[bits], _ignore(config, True))
        raw = config.raw | {"quantization_config": quantization}
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


def _ignore(config: ModelConfig, experts: bool) -> list[str]:
    """HIGH_PRECISION in the checkpoint's names, so other readers of compressed-tensors match them; with
    experts (Llama 4) that the scheme leaves as they are, those too (vLLM would quantize them otherwise)."""
    ignore = [p if p.startswith("re:") else module_key_to_checkpoint_key(config, p) for p in HIGH_PRECISION]
    if experts and config.num_experts:
        ignore.append(r"re:.*feed_forward\.experts.*")
    if config.weight_prefix:  # a multimodal Llama 4: its vision tower stays as it was
        ignore += ["re:vision_model.*", "re:multi_modal_projector.*"]
    return ignore


def _group(model: nn.Module, keys: list[str], bits: int, group: int | None) -> int | None:
    """The group size to write: the one asked for, checked against every linear before anything is
    written; by default WRITTEN_GROUP's (int8: per channel), and for int4 where 128 does not divide some
    layer's inputs (SmolLM2's 576) the largest of 64 and 32 that does."""
    names = [key.removesuffix(".weight") for key in keys]
    linears = [(name, model.get_submodule(name)) for name in names]
    if group is None and bits == 4:
        fits = [g for g in (128, 64, 32) if all(m.in_features % g == 0 for _, m in linears)]
        group = fits[0] if fits else 128  # none fits: the check below names a layer
    elif group is None:
        return WRITTEN_GROUP[bits]
    for name, linear in linears:
        check_shape(linear.in_features, linear.out_features, group, name, rows=1)
    return group


def pack_quantized(
    weight: torch.Tensor,  # [N, K]
    bits: int,
    group: int | None,  # weights a scale covers along K; None: one per output channel
    symmetric: bool,
) -> dict[str, torch.Tensor]:
    """A linear's weight [N, K] as compressed-tensors' pack-quantized tensors (the module doc): codes and
    (asymmetric) zero points stored as unsigned, + 2^(bits-1); zero points packed along N."""
    scale_dtype = weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.float32
    q, zero, scale = rounded_codes(weight, bits, group, scale_dtype, symmetric)
    middle = 1 << (bits - 1)
    tensors = {
        "weight_packed": pack_int32(q + middle, bits),
        "weight_scale": scale,
        "weight_shape": torch.tensor(weight.shape, dtype=torch.int64),
    }
    if not symmetric:
        tensors["weight_zero_point"] = pack_int32((zero + middle).t().contiguous(), bits).t().contiguous()
    return tensors
