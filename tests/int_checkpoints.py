"""Writers of GPTQ and AWQ checkpoints for the tests, as AutoGPTQ and AutoAWQ pack them (their loops, in
numpy), from a high-precision checkpoint: each decoder linear's weight rounded asymmetrically (or
symmetrically) in groups, optionally in a random act order. Returns the directory and the weights the
codes stand for (fp32), the reference the loaded model is held to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from redline.models.quantize import QUANTIZED
from redline.quant.int_scheme import pack_quantized_config

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack: nibble i of a word holds column order_map[i]


def round_groups(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor):
    """GPTQ's rounding of w [N, K] by input k's group g_idx[k]: (q [N, K], zero [G, N], scale [G, N] fp16)."""
    n, k = w.shape
    top = (1 << bits) - 1
    groups = k // group
    scale, zero = torch.empty(groups, n), torch.empty(groups, n)
    for g in range(groups):
        cols = w[:, g_idx == g].float()
        low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            high = torch.maximum(low.abs(), high)
            low = -high
        s = ((high - low) / top).clamp(min=1e-8).half().float()
        scale[g] = s
        # asymmetric zeros from 1: the v1 format stores zero - 1 (AutoGPTQ's -1 spills into its neighbours)
        zero[g] = torch.full_like(s, (top + 1) // 2) if sym else (-low / s).round().clamp(1, top)
    q = (w.float() / scale[g_idx].t() + zero[g_idx].t()).round().clamp(0, top).to(torch.int64)
    return q, zero.to(torch.int64), scale.half()


def pack_columns(values: np.ndarray, bits: int) -> np.ndarray:  # [K, N] -> [K bits / 32, N]: AutoGPTQ's loop
    per = 32 // bits
    packed = np.zeros((values.shape[0] // per, values.shape[1]), dtype=np.uint32)
    for row in range(packed.shape[0]):
        for j in range(per):
            packed[row] |= values[row * per + j].astype(np.uint32) << (bits * j)
    return packed.view(np.int32)


def pack_rows(values: np.ndarray, bits: int, order: list[int] | None = None) -> np.ndarray:  # [R, C b / 32]
    per = 32 // bits
    order = order or list(range(per))
    packed = np.zeros((values.shape[0], values.shape[1] // per), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for i in range(per):
            packed[:, col] |= values[:, col * per + order[i]].astype(np.uint32) << (bits * i)
    return packed.view(np.int32)


def write_int_checkpoint(
    src: Path, out: Path, method: str, bits: int = 4, group: int | None = 32, sym: bool = False,
    act_order: bool = False, v2: bool = False, biases: bool = False, seed: int = 0,
) -> tuple[Path, dict[str, torch.Tensor]]:  # fmt: skip
    """A gptq (v1 format: zeros stored minus one; v2: as they are), awq or compressed-tensors
    (pack-quantized, packed by the compressed_tensors library) copy of src's single-file checkpoint. group
    None: one per output channel (GPTQ's -1). biases: zero biases for every linear, as AutoGPTQ wrote."""
    out.mkdir(parents=True)
    tensors, reference = load_file(src / "model.safetensors"), {}
    generator = torch.Generator().manual_seed(seed)
    linears = [
        k for k in tensors if k.endswith(".weight") and k.rpartition(".")[0].rpartition(".")[2] in QUANTIZED
    ]
    for key in linears:
        w = tensors.pop(key).float()
        n, k = w.shape
        size = k if group is None else group
        g_idx = torch.arange(k) // size
        if act_order:
            g_idx = g_idx[torch.randperm(k, generator=generator)]
        q, zero, scale = round_groups(w, bits, size, sym, g_idx)
        reference[key] = (q - zero[g_idx].t()).float() * scale[g_idx].t().float()
        prefix = key.removesuffix(".weight")
        if biases:
            tensors[f"{prefix}.bias"] = torch.zeros(n, dtype=torch.float16)
        if method == "compressed-tensors":  # the library's own packing: signed codes and zero points
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            middle = 1 << (bits - 1)
            tensors[f"{prefix}.weight_packed"] = pack_to_int32((q - middle).to(torch.int8), bits)
            if not sym:  # symmetric: no zero points stored (the middle code)
                zero_points = (zero - middle).t().contiguous().to(torch.int8)  # [N, G]
                tensors[f"{prefix}.weight_zero_point"] = pack_to_int32(zero_points, bits, packed_dim=0)
            tensors[f"{prefix}.weight_scale"] = scale.t().contiguous().bfloat16()
            tensors[f"{prefix}.weight_shape"] = torch.tensor([n, k])
            if act_order:  # llm-compressor writes a g_idx with actorder alone
                tensors[f"{prefix}.weight_g_idx"] = g_idx.to(torch.int32)
            reference[key] = (q - zero[g_idx].t()).float() * scale[g_idx].t().bfloat16().float()
            continue
        if method == "gptq":
            tensors[f"{prefix}.qweight"] = torch.from_numpy(pack_columns(q.t().numpy(), bits))
            tensors[f"{prefix}.qzeros"] = torch.from_numpy(pack_rows((zero - (0 if v2 else 1)).numpy(), bits))
            tensors[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        else:
            tensors[f"{prefix}.qweight"] = torch.from_numpy(pack_rows(q.t().numpy(), 4, AWQ_ORDER))
            tensors[f"{prefix}.qzeros"] = torch.from_numpy(pack_rows(zero.numpy(), 4, AWQ_ORDER))
        tensors[f"{prefix}.scales"] = scale
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if method == "compressed-tensors":
        quant = pack_quantized_config(bits, group, sym, ["lm_head"])
        quant["config_groups"]["group_0"]["weights"]["actorder"] = "group" if act_order else None
    elif method == "gptq":
        quant = {"quant_method": "gptq", "bits": bits, "group_size": group or -1, "desc_act": act_order,
                 "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"}  # fmt: skip
    else:
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return out, reference
