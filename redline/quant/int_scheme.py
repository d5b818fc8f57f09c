"""Which weight-only integer checkpoints redline reads: the `quantization_config` of config.json, as vLLM
reads them (the tensors: models/int_checkpoint.py).

- gptq (AutoGPTQ, GPTQModel; `checkpoint_format` gptq or gptq_v2): 4 or 8 bits, groups of 32 / 64 / 128
  or per channel (-1), symmetric (`sym`) or with zero points, act order (`desc_act`) or not;
- awq (AutoAWQ, `version` gemm): 4 bits, groups of 32 / 64 / 128, zero points;
- compressed-tensors `pack-quantized` (llm-compressor's W4A16 / W8A16, and what `redline quantize
  --scheme int4|int8` writes): 4 or 8 bits, groups or per channel, symmetric or with zero points,
  `actorder` group (a g_idx) or not.

Anything else (3 bits, AWQ's gemv / exllama / marlin layouts, activation quantization beside the weights,
a GPTQ `marlin` checkpoint) gets a ConfigError naming it. Modules in `ignore` / `modules_to_not_convert`
stay in high precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redline.config import ConfigError

# `redline quantize`: int4 in groups of 128 (or the largest of 64, 32 that fits the model) with zero points
# (W4A16_ASYM: round to nearest without zero points cost SmolLM2 38% of perplexity), int8 symmetric per
# channel (W8A16)
WRITTEN_GROUP, WRITTEN_SYMMETRIC = {4: 128, 8: None}, {4: False, 8: True}


@dataclass(frozen=True)
class IntScheme:
    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int  # 4 or 8
    group: int | None  # weights a scale covers along the input; None: the whole row (channel-wise)
    symmetric: bool  # no zero points stored (gptq: `sym`, whose stored zeros are all the midpoint)
    act_order: bool  # groups follow a permutation of the inputs (a g_idx tensor per linear)
    zero_offset: int = 0  # added to stored zeros: 1 in AutoGPTQ's v1 format, which stores zero - 1
    ignore: tuple[str, ...] = ()

    def __str__(self) -> str:
        groups = "per channel" if self.group is None else f"groups of {self.group}"
        order = ", act order" if self.act_order else ""
        zeros = "symmetric" if self.symmetric else "zero points"
        return f"{self.method} int{self.bits}, {groups}, {zeros}{order}"


def int_scheme(raw: dict[str, Any], source: str = "config.json") -> IntScheme | None:
    """The checkpoint's weight-only integer scheme; None when it is not one (high precision or FP8)."""
    q = raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "gptq":
        return _gptq(q, source)
    if method == "awq":
        return _awq(q, source)
    if method == "compressed-tensors" and q.get("format") == "pack-quantized":
        return _pack_quantized(q, source)
    return None


def _group(size: Any, source: str) -> int | None:
    if size in (-1, None):
        return None
    if size not in (32, 64, 128):
        raise ConfigError(f"{source}: group size {size} is not supported (32, 64, 128 or per channel)")
    return int(size)


def _gptq(q: dict[str, Any], source: str) -> IntScheme:
    bits, form = q.get("bits"), q.get("checkpoint_format", "gptq")
    if bits not in (4, 8):
        raise ConfigError(f"{source}: GPTQ with {bits} bits is not supported (4 or 8)")
    if form not in ("gptq", "gptq_v2") or q.get("is_marlin_format"):
        form = "marlin" if q.get("is_marlin_format") else form
        raise ConfigError(f"{source}: GPTQ checkpoint_format {form!r} is not supported (gptq, gptq_v2)")
    if q.get("lm_head") or q.get("dynamic"):
        what = "a quantized lm_head" if q.get("lm_head") else "per-module overrides (dynamic)"
        raise ConfigError(f"{source}: GPTQ with {what} is not supported")
    ignore = tuple(q.get("modules_to_not_convert") or ())
    return IntScheme("gptq", bits, _group(q.get("group_size"), source), bool(q.get("sym", True)),
                     bool(q.get("desc_act")), 1 if form == "gptq" else 0, ignore)  # fmt: skip


def _awq(q: dict[str, Any], source: str) -> IntScheme:
    bits, version = q.get("bits", q.get("w_bit")), str(q.get("version", "gemm")).lower()
    if bits != 4:
        raise ConfigError(f"{source}: AWQ with {bits} bits is not supported (4)")
    if version != "gemm":
        raise ConfigError(f"{source}: AWQ version {version!r} is not supported (gemm)")
    if not q.get("zero_point", True):
        raise ConfigError(f"{source}: AWQ without zero points is not supported")
    group = _group(q.get("group_size", q.get("q_group_size")), source)
    return IntScheme("awq", 4, group, False, False, 0, tuple(q.get("modules_to_not_convert") or ()))


def _pack_quantized(q: dict[str, Any], source: str) -> IntScheme:
    groups = list((q.get("config_groups") or {}).items())
    if len(groups) != 1:
        raise ConfigError(f"{source}: {len(groups)} compressed-tensors config groups (one is supported)")
    name, group = groups[0]
    weights = group.get("weights") or {}
    if "Linear" not in group.get("targets", ["Linear"]):
        targets = group.get("targets")
        raise ConfigError(f"{source}: config group {name!r} targets {targets} (Linear is supported)")
    if group.get("input_activations") or group.get("output_activations"):
        raise ConfigError(f"{source}: config group {name!r} quantizes activations (weight-only is supported)")
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if weights.get("type", "int") != "int" or bits not in (4, 8):
        kind = f"{bits}-bit {weights.get('type')}"
        raise ConfigError(f"{source}: config group {name!r}: {kind} weights (int4 or int8 are supported)")
    if strategy not in ("group", "channel"):
        raise ConfigError(f"{source}: config group {name!r}: weight strategy {strategy!r} (group or channel)")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "weight", "static", "group", "dynamic"):
        raise ConfigError(f"{source}: config group {name!r}: actorder {actorder!r} is not supported")
    if q.get("kv_cache_scheme"):
        raise ConfigError(f"{source}: a quantized KV cache (kv_cache_scheme) is not supported")
    size = _group(weights.get("group_size"), source) if strategy == "group" else None
    # "group" (alias "dynamic") stores a g_idx; "weight" (alias "static") only ordered the rounding
    return IntScheme("compressed-tensors", bits, size, bool(weights.get("symmetric", True)),
                     actorder in ("group", "dynamic"), 0, tuple(q.get("ignore") or ()))  # fmt: skip


def pack_quantized_config(bits: int, group: int | None, symmetric: bool, ignore: list[str]) -> dict[str, Any]:
    """The quantization_config `redline quantize --scheme int4|int8` writes: llm-compressor's W4A16(_ASYM)
    / W8A16 (int weights, `group` weights a scale or None: one per output channel)."""
    strategy = "channel" if group is None else "group"
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False, "actorder": None,
               "strategy": strategy, "group_size": group, "observer": "minmax"}  # fmt: skip
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": None,
              "output_activations": None, "format": "pack-quantized"}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme},
        "ignore": ignore,
    }
