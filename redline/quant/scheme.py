"""Which FP8 checkpoints redline reads: the `quantization_config` of config.json.

- compressed-tensors (`float-quantized` or `naive-quantized`: both store e4m3 weights as they are):
  - `strategy: channel` weights ([N, 1] `weight_scale`), activations dynamic per token: the FP8-dynamic
    Llama 3.x / 4 releases (RedHatAI/...-FP8-dynamic) and what `redline quantize` (--scheme fp8) writes;
  - `strategy: tensor` weights ([1] `weight_scale`) with static per-tensor activation scales
    (`input_activations: {dynamic: false, strategy: tensor}`, an `input_scale` per linear): the "-FP8"
    releases (neuralmagic / RedHatAI Meta-Llama-3.1-8B-Instruct-FP8). Scales are often bf16 on disk;
    they load as fp32 (exact).
  Modules in `ignore` (names or `re:` patterns) stay in high precision. Releases of multimodal Llama 4
  name modules as the checkpoint does ("language_model.model.layers.0.feed_forward.router"), redline
  without the prefix and with `mlp` ("model.layers.0.mlp.router"): both names are matched.
- fbgemm_fp8 (Meta's FP8 Llama 4): the same tensors (weight_scale [N, 1]); `modules_to_not_convert`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from redline.config import ConfigError
from redline.quant.int_scheme import int_scheme

_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Fp8Scheme:
    ignore: tuple[str, ...] = ()
    per_tensor: bool = False  # one weight scale per tensor (else one per output channel)
    static_input: bool = False  # a calibrated per-tensor `input_scale` per linear (else per token)

    def keeps_high_precision(self, *names: str) -> bool:
        """True when an ignore entry matches any of the module's names. 're:.*q_proj$' matches
        'model.layers.0.self_attn.q_proj' (re.match, as compressed-tensors does); so do the full name,
        'self_attn.q_proj' and 'model.layers.0.self_attn' (a module around it: transformers skips what an
        fbgemm_fp8 `modules_to_not_convert` entry contains), but not 'q_pro' (whole name parts only)."""
        return any(
            re.match(pattern[3:], name) if pattern.startswith("re:") else f".{pattern}." in f".{name}."
            for pattern in self.ignore
            for name in names
        )


def fp8_scheme(raw: dict[str, Any], source: str = "config.json") -> Fp8Scheme | None:
    q = raw.get("quantization_config")
    if not q or int_scheme(raw, source) is not None:  # weight-only int4 / int8 (quant/int_scheme.py)
        return None
    method = q.get("quant_method")
    if method == "fbgemm_fp8":
        return Fp8Scheme(tuple(q.get("modules_to_not_convert") or ()))
    if method != "compressed-tensors":
        raise ConfigError(
            f"{source}: quantization {method!r} is not supported; "
            "redline reads FP8 checkpoints (compressed-tensors, fbgemm_fp8) and int4 / int8 ones (gptq, awq, "
            "compressed-tensors pack-quantized)"
        )
    if q.get("format", "float-quantized") not in _FORMATS:
        raise ConfigError(f"{source}: compressed-tensors format {q.get('format')!r} is not supported")
    if q.get("kv_cache_scheme"):
        raise ConfigError(f"{source}: a quantized KV cache (kv_cache_scheme) is not supported")
    schemes = {_group_scheme(name, group, source) for name, group in (q.get("config_groups") or {}).items()}
    if len(schemes) > 1:
        raise ConfigError(f"{source}: config groups with different FP8 schemes are not supported")
    per_tensor, static_input = schemes.pop() if schemes else (False, False)
    return Fp8Scheme(tuple(q.get("ignore") or ()), per_tensor, static_input)


def _group_scheme(name: str, group: dict[str, Any], source: str) -> tuple[bool, bool]:
    """(per-tensor weight scales, static input scales) of one config group."""
    weights = group.get("weights") or {}
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise ConfigError(f"{source}: config group {name!r} is not 8-bit float weights")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise ConfigError(
            f"{source}: FP8 weight strategy {strategy!r} is not supported "
            "(channel-wise or per-tensor scales only)"
        )
    activations = group.get("input_activations") or {}
    if weights.get("symmetric") is False or activations.get("symmetric") is False:
        raise ConfigError(f"{source}: config group {name!r} is asymmetric (zero points are not supported)")
    static = bool(activations) and not activations.get("dynamic", False)
    if static and activations.get("strategy") != "tensor":
        raise ConfigError(
            f"{source}: static activation scales with strategy {activations.get('strategy')!r} are not "
            "supported (per-tensor static scales, or dynamic per-token scales)"
        )
    return strategy == "tensor", static


def compressed_tensors_config(ignore: list[str]) -> dict[str, Any]:
    """The quantization_config `redline quantize --scheme fp8` writes."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ignore,
    }
