"""Real checkpoint layouts into the target model: shards, bf16 on disk, multimodal Llama 4, bad files."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, llama4_hf_config, save_hf_model

from redline.models.build import load_target
from redline.models.loader import CheckpointError, checkpoint_files, save_weights


def logits_of(model, tokens):
    hidden, _ = model(tokens, torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1))
    return model.logits(hidden)


def test_sharded_checkpoint(tmp_path, tokenizer_dir):
    hf = build_hf_model(llama3_hf_config(tie_word_embeddings=False))
    model_dir = save_hf_model(hf, tmp_path / "sharded", tokenizer_dir, max_shard_size="60KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(set(checkpoint_files(model_dir).values())) > 3
    tokens = torch.randint(0, hf.config.vocab_size, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(
            logits_of(load_target(model_dir, torch.float32), tokens), hf(tokens).logits
        )


def test_bf16_on_disk_loads_as_fp32_and_bf16(tmp_path, tokenizer_dir):
    hf = build_hf_model(llama3_hf_config()).to(torch.bfloat16)
    model_dir = save_hf_model(hf, tmp_path / "bf16", tokenizer_dir)
    fp32 = load_target(model_dir, torch.float32)
    bf16 = load_target(model_dir, torch.bfloat16)
    ref = hf.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    assert fp32.model.layers[1].self_attn.q_proj.weight.dtype == torch.float32
    assert torch.equal(fp32.model.layers[1].self_attn.q_proj.weight, ref.float())  # bf16 -> fp32 is exact
    assert torch.equal(bf16.model.layers[1].self_attn.q_proj.weight, ref)


def test_multimodal_llama4_checkpoint(tmp_path, tokenizer_dir):
    """A Llama4ForConditionalGeneration layout: text weights under language_model., vision weights beside."""
    hf = build_hf_model(llama4_hf_config())
    out = tmp_path / "maverick-like"
    state = {f"language_model.{k}": v for k, v in hf.state_dict().items()}
    state["vision_model.patch_embedding.linear.weight"] = torch.randn(8, 4)
    state["multi_modal_projector.linear_1.weight"] = torch.randn(4, 4)
    save_weights(state, out, max_shard_bytes=100_000)
    text = json.loads(hf.config.to_json_string())
    text["attn_temperature_tuning"] = 4  # as the real configs store it
    config = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text,
    }
    (out / "config.json").write_text(json.dumps(config))
    tokens = torch.randint(0, hf.config.vocab_size, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(
            logits_of(load_target(out, torch.float32), tokens), hf(tokens).logits, atol=1e-4, rtol=0
        )


@pytest.fixture
def saved(tmp_path, tokenizer_dir):
    hf = build_hf_model(llama3_hf_config(tie_word_embeddings=False))
    return save_hf_model(hf, tmp_path / "m", tokenizer_dir), hf


def test_missing_tensor_is_named(saved):
    model_dir, hf = saved
    state = {k: v for k, v in hf.state_dict().items() if k != "model.layers.2.mlp.up_proj.weight"}
    save_weights(state, model_dir)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_target(model_dir)


def test_mis_shaped_tensor_is_named_with_its_file(saved):
    model_dir, hf = saved
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_weights(state, model_dir)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*k_proj\.weight.*\[8, 64\].*\[32, 64\]"):
        load_target(model_dir)


def test_unexpected_tensor_is_named(saved):
    model_dir, hf = saved
    save_weights({**hf.state_dict(), "model.layers.9.mystery.weight": torch.zeros(2)}, model_dir)
    with pytest.raises(CheckpointError, match=r"mystery"):
        load_target(model_dir)


def test_corrupt_file_is_named(saved):
    model_dir, _ = saved
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_target(model_dir)
