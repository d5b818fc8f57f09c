"""Which FP8 checkpoints redline reads: the `quantization_config` of config.json.

- compressed-tensors (the published FP8 Llama 3.x / 4 releases, and what `redline quantize` writes):
  `format: float-quantized`, weights 8-bit float with `strategy: channel`, activations dynamic per
  token; modules in `ignore` (names or `re:` patterns) stay in high precision.
- fbgemm_fp8 (Meta's FP8 Llama 4): the same tensors (weight_scale [N, 1]); `modules_to_not_convert`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from redline.config import ConfigError


@dataclass(frozen=True)
class Fp8Scheme:
    ignore: tuple[str, ...] = ()

    def keeps_high_precision(self, module: str) -> bool:
        """'model.layers.0.self_attn.q_proj' matches 're:.*q_proj$', 'self_attn.q_proj' and itself."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif module == pattern or module.endswith("." + pattern):
                return True
        return False


def fp8_scheme(raw: dict[str, Any], source: str = "config.json") -> Fp8Scheme | None:
    q = raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fbgemm_fp8":
        return Fp8Scheme(tuple(q.get("modules_to_not_convert") or ()))
    if method != "compressed-tensors":
        raise ConfigError(
            f"{source}: quantization {method!r} is not supported; "
            "redline reads FP8 checkpoints in the compressed-tensors or fbgemm_fp8 layout"
        )
    if q.get("format", "float-quantized") != "float-quantized":
        raise ConfigError(f"{source}: compressed-tensors format {q.get('format')!r} is not supported")
    for name, group in (q.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ConfigError(f"{source}: config group {name!r} is not 8-bit float weights")
        if weights.get("strategy") != "channel":
            raise ConfigError(
                f"{source}: FP8 weight strategy {weights.get('strategy')!r} is not supported "
                "(channel-wise scales only)"
            )
        activations = group.get("input_activations")
        if activations and not activations.get("dynamic", False):
            raise ConfigError(
                f"{source}: static activation scales are not supported (dynamic per token only)"
            )
    return Fp8Scheme(tuple(q.get("ignore") or ()))


def compressed_tensors_config(ignore: list[str]) -> dict[str, Any]:
    """The quantization_config `redline quantize` writes."""
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
