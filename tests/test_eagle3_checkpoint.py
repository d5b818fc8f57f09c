"""EAGLE-3 draft checkpoints: both key layouts, round trips, fit checks, aux hidden states."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file

from redline.config import ConfigError
from redline.models.build import load_target, load_with_draft
from redline.models.eagle3 import aux_layers_of, default_aux_layers, load_draft, save_draft
from redline.train.random_init import write_random_draft


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    hf = build_hf_model(llama3_hf_config(num_hidden_layers=6, tie_word_embeddings=False))
    model_dir = save_hf_model(hf, tmp_path_factory.mktemp("target") / "t", tokenizer_dir)
    return model_dir, hf


def state(draft) -> dict[str, torch.Tensor]:
    return {k: v for k, v in draft.state_dict().items()}


def test_save_then_load_is_bit_exact(target, tmp_path):
    model_dir, _ = target
    model, first = load_with_draft(model_dir, write_random_draft(model_dir, tmp_path / "a", draft_vocab=100),
                                   torch.float32)  # fmt: skip
    save_draft(first, tmp_path / "b")
    second = load_draft(tmp_path / "b", model, torch.float32)
    a, b = state(first), state(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert first.d2t.dtype == torch.int64 and first.t2d.dtype == torch.bool
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 100 and config["target_hidden_size"] == 64
    keys = load_file(tmp_path / "b" / "model.safetensors").keys()
    assert "midlayer.self_attn.q_proj.weight" in keys and "fc.weight" in keys and "d2t" in keys


@pytest.mark.parametrize("prefix", ["model.layers.0.", "layers.0."])
def test_other_key_layouts_load_the_same_weights(target, tmp_path, prefix):
    model_dir, _ = target
    src = write_random_draft(model_dir, tmp_path / "src", draft_vocab=100)
    model = load_target(model_dir, torch.float32, aux_layers=aux_layers_of(src, 6))
    weights = load_file(src / "model.safetensors")
    renamed = {
        (prefix + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
        for k, v in weights.items()
    }
    out = tmp_path / "other"
    out.mkdir()
    save_file(renamed, out / "model.safetensors")
    (out / "config.json").write_text((src / "config.json").read_text())
    a, b = state(load_draft(src, model, torch.float32)), state(load_draft(out, model, torch.float32))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_own_embeddings_and_missing_lm_head(target, tmp_path):
    """Own embed_tokens are used; without lm_head (full draft vocabulary) the target's is shared."""
    model_dir, _ = target
    src = write_random_draft(model_dir, tmp_path / "src")  # draft vocab = target vocab, no d2t offsets
    model = load_target(model_dir, torch.float32, aux_layers=aux_layers_of(src, 6))
    weights = load_file(src / "model.safetensors")
    weights["embed_tokens.weight"] = torch.randn(384, 64)
    del weights["lm_head.weight"], weights["d2t"], weights["t2d"]
    save_file(weights, src / "model.safetensors")
    draft = load_draft(src, model, torch.float32)
    assert torch.equal(draft.embed(torch.tensor([3])), weights["embed_tokens.weight"][3:4])
    assert draft.lm_head.weight is model.lm_head.weight
    assert torch.equal(draft.to_target(torch.arange(384)), torch.arange(384))


def test_published_config_without_eagle_config_uses_default_aux_layers(target, tmp_path):
    model_dir, _ = target
    src = write_random_draft(model_dir, tmp_path / "d", draft_vocab=50)
    config = json.loads((src / "config.json").read_text())
    del config["target_hidden_size"]  # as the published drafts: no eagle_config either
    (src / "config.json").write_text(json.dumps(config))
    model, _ = load_with_draft(model_dir, src, torch.float32)
    assert model.aux_layers == default_aux_layers(6) == (2, 3, 3)
    assert default_aux_layers(32) == (2, 16, 29) and default_aux_layers(48) == (2, 24, 45)


def test_aux_hidden_states_are_the_inputs_of_the_chosen_layers(target):
    """aux id i = the input of layer i = HF's hidden_states[i]; all taken in the one forward."""
    model_dir, hf = target
    model = load_target(model_dir, torch.float32, aux_layers=(1, 3, 5))
    tokens = torch.randint(0, 384, (2, 9))
    with torch.no_grad():
        _, aux = model(tokens, torch.arange(9).expand(2, -1))
        expected = hf(tokens, output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux, torch.cat([expected[i] for i in (1, 3, 5)], dim=-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"target_hidden_size": 128}, "target_hidden_size 128"),
        ({"vocab_size": 500}, "vocab_size 500"),
        ({"draft_vocab_size": 1000}, "draft_vocab_size 1000"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}}, "aux layer ids"),
        ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 draft"),
    ],
)
def test_mismatched_drafts_get_a_clear_error(target, tmp_path, change, message):
    model_dir, _ = target
    model = load_target(model_dir, torch.float32)
    src = write_random_draft(model_dir, tmp_path / "d", draft_vocab=100)
    config = {**json.loads((src / "config.json").read_text()), **change}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_draft(src, model, torch.float32)


def test_sharded_bin_draft_loads_the_same_weights(target, tmp_path):
    """pytorch_model-0000N-of-0000M.bin + pytorch_model.bin.index.json, as transformers 4.x wrote them."""
    model_dir, _ = target
    src = write_random_draft(model_dir, tmp_path / "src", draft_vocab=100)
    model = load_target(model_dir, torch.float32, aux_layers=aux_layers_of(src, 6))
    weights = load_file(src / "model.safetensors")
    split = split_torch_state_dict_into_shards(
        weights, filename_pattern="pytorch_model{suffix}.bin", max_shard_size="40KB"
    )
    out = tmp_path / "bin"
    out.mkdir()
    for filename, keys in split.filename_to_tensors.items():
        torch.save({k: weights[k] for k in keys}, out / filename)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text((src / "config.json").read_text())
    assert len(split.filename_to_tensors) > 2
    a, b = state(load_draft(src, model, torch.float32)), state(load_draft(out, model, torch.float32))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
