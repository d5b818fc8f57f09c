"""A llama GGUF's tensors as Hugging Face tensors: names mapped, values dequantized, Q/K rows unpermuted."""

from __future__ import annotations

import re

import gguf
import numpy as np
import torch

# llama.cpp's name -> the HF LlamaForCausalLM name; {i} is the layer number.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, precomputed; it becomes config.json's rope_scaling


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a llama GGUF tensor (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight),
    or None for a name with no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def permute_qk(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What convert_hf_to_gguf does to q_proj / k_proj rows (weights or biases), HF order -> GGUF order.

    rows: [num_heads * head_dim, ...]. HF's rotate-half RoPE pairs row i of a head with row i + head_dim/2;
    llama.cpp rotates adjacent rows (2i, 2i + 1). So within each head, row i goes to 2i and row
    i + head_dim/2 to 2i + 1. Example, one head of head_dim 8 (HF rows h0..h7):
        GGUF rows = h0 h4 h1 h5 h2 h6 h3 h7
    As tensor ops: view [heads, 2, head_dim/2, ...] (which half, index in half), swap the two middle axes."""
    shape = rows.shape
    half = shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half, *shape[1:]).transpose(1, 2).reshape(shape)


def unpermute_qk(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of permute_qk, GGUF order -> HF order. rows: [num_heads * head_dim, ...].

    Within each head, GGUF row 2i is HF row i and GGUF row 2i + 1 is HF row i + head_dim/2. Example, one
    head of head_dim 8 stored as g0..g7 = h0 h4 h1 h5 h2 h6 h3 h7:
        HF rows = g0 g2 g4 g6 g1 g3 g5 g7
    As tensor ops: view [heads, head_dim/2, 2, ...] (pair index, which of the pair), swap the middle axes.
    For k_proj, num_heads is the number of KV heads."""
    shape = rows.shape
    half = shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def hf_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions fastest first (ne0 = a linear layer's input width); HF slowest first."""
    return tuple(int(d) for d in reversed(tensor.shape))


def dequantized(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """The tensor's values in fp32 and HF orientation ([out_features, in_features] for a linear layer),
    dequantized by gguf.quants.dequantize from the memory-mapped bytes."""
    # a plain ndarray view of the mapping: dequantize slices it per group of rows, and each slice of an
    # np.memmap pays Python-level bookkeeping that would dominate the import
    values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only mapping: own a copy
        values = values.copy()
    return torch.from_numpy(values.astype(np.float32, copy=False).reshape(hf_shape(tensor)))


def hf_tensor(tensor: gguf.ReaderTensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """dequantized(tensor), with q_proj / k_proj rows back in HF order."""
    values = dequantized(tensor)
    name = tensor.name.rsplit(".", 2)
    if name[-2] == "attn_q":
        return unpermute_qk(values, num_heads)
    if name[-2] == "attn_k":
        return unpermute_qk(values, num_kv_heads)
    return values
