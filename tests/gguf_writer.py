"""GGUF files written from HF Llama models with gguf.GGUFWriter, the way llama.cpp's convert_hf_to_gguf does.

Metadata under llama.cpp's keys, tensor names from gguf's own TensorNameMap, q_proj / k_proj rows permuted for
llama.cpp's adjacent-pair RoPE, 1-D tensors in F32, Llama 3 rope scaling as a `rope_freqs` tensor, the
byte-level BPE vocabulary as tokens + types + merges. Quantized with gguf.quants.quantize where gguf-py can
(BF16, Q4_0, Q4_1, Q8_0); K-quant tensors (which gguf-py cannot quantize) get random blocks of that layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
_CONTROL, _NORMAL = 3, 1

# Byte offsets of the fp16 super-block scales (d, dmin) in one block, from ggml-common.h's block_q*_K.
_K_QUANT_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_K_QUANT_D = {Q.Q4_K: 1e-4, Q.Q5_K: 5e-5, Q.Q6_K: 2e-5}  # weights of magnitude ~0.05, like the model's


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: rows of each head as (half, index) -> (index, half)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def random_k_quant(shape: tuple[int, ...], qtype: Q, generator: np.random.Generator) -> np.ndarray:
    """Random bytes of a K-quant tensor of `shape` (HF order), with every block's fp16 scale set to a small
    positive value, so the dequantized weights are finite and of a sensible size."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = generator.integers(0, 256, (math.prod(shape) // block_values, block_bytes), dtype=np.uint8)
    for offset in _K_QUANT_SCALES[qtype]:
        scale = generator.uniform(0.5, 1.5, len(blocks)) * _K_QUANT_D[qtype]
        blocks[:, offset : offset + 2] = scale.astype(np.float16)[:, None].view(np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // block_values * block_bytes)


def llama3_rope_freqs(config) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for a llama3 rope scaling (from the config's own rope parameters)."""
    rope = config.rope_parameters
    dim, base = config.head_dim, rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer_dir: Path, pre: str, eos: str, eot: str | None) -> None:
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([_CONTROL if t in special else _NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[config["bos_token"]])
    post = spec.get("post_processor") or {}  # gguf.SpecialVocab: add_bos when the template starts with bos
    single = post.get("single", [{}]) if post.get("type") == "TemplateProcessing" else [{}]
    writer.add_add_bos_token(single[0].get("SpecialToken", {}).get("id") == config["bos_token"])
    writer.add_eos_token_id(vocab[eos])
    if eot is not None:
        writer.add_eot_token_id(vocab[eot])
    writer.add_chat_template(config["chat_template"])


def write_gguf(
    model,
    tokenizer_dir: Path,
    path: Path,
    types: dict[str, Q],
    pre: str = "gpt-2",
    eos: str = "<|eot_id|>",
    eot: str | None = None,
) -> Path:
    """Write `model` (an HF LlamaForCausalLM) as a llama GGUF; types maps a GGUF tensor's name without the
    layer prefix ("attn_q.weight", "token_embd.weight") to its type (default F16; 1-D tensors are F32)."""
    c = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_dimension_count(c.head_dim)
    _add_tokenizer(writer, tokenizer_dir, pre, eos, eot)
    if c.rope_parameters["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(c))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    generator = np.random.default_rng()
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # a tied checkpoint has no lm_head tensor
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = tensor.float().numpy()
        if hf_name.endswith("q_proj.weight"):
            data = permute(data, c.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            data = permute(data, c.num_key_value_heads)
        qtype = (
            Q.F32
            if data.ndim == 1
            else types.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, Q.F16)
        )
        if qtype in _K_QUANT_SCALES:
            writer.add_tensor(name, random_k_quant(data.shape, qtype, generator), raw_dtype=qtype)
        elif qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, gguf.quants.quantize(data, qtype))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
