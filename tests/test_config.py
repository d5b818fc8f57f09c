"""config.json quirks of real Llama 3.x and Llama 4 releases."""

from __future__ import annotations

import json

import pytest

from redline.config import ConfigError, ModelConfig

LLAMA31_8B = {  # the shape of meta-llama/Llama-3.1-8B-Instruct's config.json
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}

MAVERICK_TEXT = {  # text_config of meta-llama/Llama-4-Maverick-17B-128E-Instruct, abridged
    "attention_chunk_size": 8192,
    "attn_scale": 0.1,
    "attn_temperature_tuning": 4,
    "floor_scale": 8192,
    "head_dim": 128,
    "hidden_size": 5120,
    "interleave_moe_layer_step": 2,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "max_position_embeddings": 1048576,
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "use_qk_norm": False,
    "vocab_size": 202048,
    "eos_token_id": [200001, 200007, 200008],
}


def test_llama31_config():
    c = ModelConfig.from_dict(LLAMA31_8B)
    assert c.family == "llama3" and c.head_dim == 128 and c.num_kv_heads == 8
    assert c.rope.scaling == "llama3" and c.rope.theta == 500000.0 and c.rope.factor == 8.0
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert 7.9e9 < c.num_params_estimate < 8.1e9


def test_rope_parameters_form_of_transformers_5():
    raw = dict(LLAMA31_8B)
    raw["rope_parameters"] = {**raw.pop("rope_scaling"), "rope_theta": raw.pop("rope_theta")}
    assert ModelConfig.from_dict(raw).rope == ModelConfig.from_dict(LLAMA31_8B).rope


def test_multimodal_maverick_config():
    raw = {"architectures": ["Llama4ForConditionalGeneration"], "text_config": MAVERICK_TEXT}
    c = ModelConfig.from_dict(raw)
    assert c.family == "llama4" and c.weight_prefix == "language_model."
    assert c.attn_temperature_tuning is True  # stored as the int 4
    assert c.moe_layers == tuple(range(1, 48, 2))  # odd layers
    assert c.rope_layers[:4] == (True, True, True, False) and sum(c.rope_layers) == 36
    assert c.intermediate_size == 16384 and c.expert_intermediate_size == 8192
    assert c.rope.scaling == "default" and c.eos_token_ids == (200001, 200007, 200008)
    assert not c.is_chunked_layer(3) and c.is_chunked_layer(4)


def test_scout_moe_on_every_layer():
    raw = {"architectures": ["Llama4ForCausalLM"], **MAVERICK_TEXT, "interleave_moe_layer_step": 1}
    assert ModelConfig.from_dict(raw).moe_layers == tuple(range(48))


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ConfigError, match="MistralForCausalLM.*LlamaForCausalLM.*Llama4ForCausalLM"):
        ModelConfig.from_dict({**LLAMA31_8B, "architectures": ["MistralForCausalLM"]})


def test_missing_field_and_bad_json_are_named(tmp_path):
    broken = {k: v for k, v in LLAMA31_8B.items() if k != "hidden_size"}
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_dict(broken)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path / "missing")


def test_unsupported_rope_scaling_and_bad_heads():
    with pytest.raises(ConfigError, match="yarn"):
        ModelConfig.from_dict({**LLAMA31_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ModelConfig.from_dict({**LLAMA31_8B, "num_key_value_heads": 5})


def test_config_file_round_trip(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B))
    assert ModelConfig.from_dir(tmp_path) == ModelConfig.from_dict(LLAMA31_8B)
