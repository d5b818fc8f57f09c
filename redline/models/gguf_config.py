"""config.json and generation_config.json of a llama GGUF, from its metadata (llama.cpp's key names)."""

from __future__ import annotations

from typing import Any

import torch

from redline.models.gguf_reader import GGUFFile
from redline.models.gguf_rope import llama3_rope_scaling, shortest_float32
from redline.models.gguf_tensors import ROPE_FREQS, dequantized

SUPPORTED_ARCHITECTURES = ("llama",)


def _int(gguf_file: GGUFFile, key: str, default: int | None = None) -> int:
    """A per-architecture integer; some files store per-layer lists, which redline runs only if uniform."""
    value = gguf_file.arch_value(key) if default is None else gguf_file.arch_value(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise gguf_file.error(f"{gguf_file.architecture}.{key} differs between layers ({value})")
        value = value[0]
    return int(value)


def check_architecture(gguf_file: GGUFFile) -> None:
    if gguf_file.architecture not in SUPPORTED_ARCHITECTURES:
        raise gguf_file.error(
            f"architecture {gguf_file.architecture!r} is not supported; redline imports GGUF files of "
            f"architecture {', '.join(map(repr, SUPPORTED_ARCHITECTURES))} (LlamaForCausalLM: Llama 3.x, ...)"
        )
    if gguf_file.arch_value("expert_count", 0):
        raise gguf_file.error("mixture-of-experts llama GGUFs (Mixtral style) are not supported")


def _rope_scaling(gguf_file: GGUFFile, theta: float, head_dim: int) -> dict[str, Any] | None:
    kind = gguf_file.arch_value("rope.scaling.type", "none")
    if kind != "none":
        raise gguf_file.error(f"rope scaling {kind!r} is not supported; redline runs 'llama3' and no scaling")
    tensor = gguf_file.tensors.get(ROPE_FREQS)
    if tensor is None:
        return None
    try:
        return llama3_rope_scaling(dequantized(tensor).numpy(), theta, head_dim)
    except ValueError as e:
        raise gguf_file.error(f"tensor {ROPE_FREQS!r}: {e}") from e


def hf_config(gguf_file: GGUFFile, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of LlamaForCausalLM (the format redline and transformers read) for a llama GGUF."""
    check_architecture(gguf_file)
    hidden = _int(gguf_file, "embedding_length")
    heads = _int(gguf_file, "attention.head_count")
    kv_heads = _int(gguf_file, "attention.head_count_kv", heads)
    head_dim = _int(gguf_file, "attention.key_length", hidden // heads)
    rotary_dim = _int(gguf_file, "rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise gguf_file.error(
            f"partial rotary embeddings ({rotary_dim} of {head_dim} dims) are not supported"
        )
    if _int(gguf_file, "attention.value_length", head_dim) != head_dim:
        raise gguf_file.error("attention.value_length differs from attention.key_length")
    # GGUF floats are float32: 9.999999747378752e-06 is how the file spells the config's 1e-05
    theta = shortest_float32(gguf_file.arch_value("rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": _int(gguf_file, "vocab_size", _embedding_rows(gguf_file)),
        "hidden_size": hidden,
        "intermediate_size": _int(gguf_file, "feed_forward_length"),
        "num_hidden_layers": _int(gguf_file, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _int(gguf_file, "context_length"),
        "rms_norm_eps": shortest_float32(gguf_file.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(gguf_file, theta, head_dim),
        "attention_bias": "blk.0.attn_q.bias" in gguf_file.tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
        "bos_token_id": gguf_file.token_id("bos"),
        "eos_token_id": gguf_file.token_id("eos"),
        "pad_token_id": gguf_file.token_id("padding"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _embedding_rows(gguf_file: GGUFFile) -> int:
    embedding = gguf_file.tensors.get("token_embd.weight")
    if embedding is None:
        raise gguf_file.error("tensor 'token_embd.weight' is missing")
    return int(embedding.shape[-1])


def generation_config(gguf_file: GGUFFile) -> dict[str, Any]:
    """generation_config.json: bos, pad, and every end-of-generation id the file names (eos, eot, eom)."""
    ids = (gguf_file.token_id(name) for name in ("eos", "eot", "eom"))
    eos = list(dict.fromkeys(i for i in ids if i is not None))
    config: dict[str, Any] = {
        "bos_token_id": gguf_file.token_id("bos"),
        "pad_token_id": gguf_file.token_id("padding"),
    }
    config["eos_token_id"] = eos[0] if len(eos) == 1 else eos or None
    return {key: value for key, value in config.items() if value is not None}
