"""A llama GGUF's tensors as Hugging Face tensors: names mapped, values dequantized, Q/K rows unpermuted."""

from __future__ import annotations

import re

import gguf
import numpy as np
import torch

# llama.cpp's name -> the HF LlamaForCausalLM name
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_MODULES = {  # in blk.{i}, with a .weight or a .bias
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, precomputed; it becomes config.json's rope_scaling


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a llama GGUF tensor (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight),
    or None for a name with no HF counterpart."""
    match = _LAYER.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_MODULES:
        return _GLOBAL_NAMES.get(gguf_name)
    return f"model.layers.{match[1]}.{_LAYER_MODULES[match[2]]}.{match[3]}"


def permute_qk(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What convert_hf_to_gguf does to q_proj / k_proj rows (weights or biases), HF order -> GGUF order.

    rows: [num_heads * head_dim, ...]. HF's rotate-half RoPE pairs row i of a head with row i + head_dim/2;
    llama.cpp rotates adjacent rows (2i, 2i + 1). So within each head, row i goes to 2i and row
    i + head_dim/2 to 2i + 1. Example, one head of head_dim 8 (HF rows h0..h7):
        GGUF rows = h0 h4 h1 h5 h2 h6 h3 h7
    As tensor ops: view [heads, 2, head_dim/2, ...] (which half, index in half), swap the two middle axes."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def unpermute_qk(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of permute_qk, GGUF order -> HF order. rows: [num_heads * head_dim, ...].

    Within each head, GGUF row 2i is HF row i and GGUF row 2i + 1 is HF row i + head_dim/2. Example, one
    head of head_dim 8 stored as g0..g7 = h0 h4 h1 h5 h2 h6 h3 h7:
        HF rows = g0 g2 g4 g6 g1 g3 g5 g7
    As tensor ops: view [heads, head_dim/2, 2, ...] (pair index, which of the pair), swap the middle axes.
    For k_proj, num_heads is the number of KV heads."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def hf_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions fastest first (ne0 = a linear layer's input width); HF slowest first."""
    return tuple(int(d) for d in reversed(tensor.shape))


def dequantized(tensor: gguf.ReaderTensor, rows: slice = slice(None)) -> torch.Tensor:
    """The tensor's values in fp32 and HF orientation ([out_features, in_features] for a linear layer),
    dequantized by gguf.quants.dequantize from the memory-mapped bytes; `rows` of them alone (a file
    holds each row's blocks together)."""
    # a plain ndarray view of the mapping: dequantize slices it per group of rows, and each slice of an
    # np.memmap pays Python-level bookkeeping that would dominate the import
    data, shape = np.asarray(tensor.data), hf_shape(tensor)
    if rows != slice(None):
        data = data.reshape(shape[0], -1)[rows]
        if data.shape[0] == 0:  # a vocabulary block past the last id: padding alone
            return torch.zeros(0, *shape[1:])
    values = gguf.quants.dequantize(data, tensor.tensor_type)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only mapping: own a copy
        values = values.copy()
    return torch.from_numpy(values.astype(np.float32, copy=False).reshape(-1, *shape[1:]))


def hf_tensor(tensor: gguf.ReaderTensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """dequantized(tensor), with q_proj / k_proj rows back in HF order."""
    values, kind = dequantized(tensor), tensor.name.rsplit(".", 2)[-2]
    if kind in ("attn_q", "attn_k"):
        return unpermute_qk(values, num_heads if kind == "attn_q" else num_kv_heads)
    return values
