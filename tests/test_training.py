"""train-target and train-draft end to end on a tiny scale, and the TTT unroll against inference."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import TINY_DRAFT, TINY_TARGET

from redline import LLM, SamplingParams
from redline.config import ModelConfig
from redline.engine.kv_cache import KVCache
from redline.models.build import load_target
from redline.models.eagle3 import Eagle3Draft, draft_config_for, load_draft, save_draft
from redline.models.llama import LlamaForCausalLM
from redline.models.random_init import llama3_config
from redline.train import data
from redline.train.draft import (
    DraftData,
    acceptance_length,
    draft_vocabulary,
    held_out_prompts,
    new_draft,
    train_draft,
)
from redline.train.target import train_target
from redline.train.ttt import ttt_mask, ttt_unroll


def test_trained_draft_is_accepted_far_more_than_untrained(trained):
    target = load_target(trained / "target", torch.float32)
    features = DraftData.load(trained / "draft" / "draft_data.pt")
    save_draft(new_draft(target, TINY_DRAFT, features.vocab), trained / "untrained")
    prompts = held_out_prompts(trained / "target", 8, 24)
    untrained = acceptance_length(trained / "target", trained / "untrained", prompts, 40)
    learned = acceptance_length(trained / "target", trained / "draft", prompts, 40)
    # K = 3: 1.0 means nothing accepted, 4.0 everything; the random draft sits near 1
    assert untrained < 1.5
    assert learned > untrained + 1.0, (learned, untrained)


def test_target_writes_hf_format_and_transformers_agrees(trained):
    transformers = pytest.importorskip("transformers")
    target_dir = trained / "target"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (target_dir / name).is_file()
    assert "chat_template" in json.loads((target_dir / "tokenizer_config.json").read_text())
    summary = json.loads((target_dir / "train_log.json").read_text())["summary"]
    assert summary["held_out_loss"] < 6.0  # ln(384) = 5.95 is the loss of a uniform guess

    prompt = held_out_prompts(target_dir, 1, 24, seed=5)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
        )
    expected = out[0, len(prompt) :].tolist()
    llm = LLM(target_dir, dtype="float32", max_batch=1)
    got = llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids
    assert got == expected


def test_saved_draft_reloads_bit_exactly(trained):
    trained_state = torch.load(trained / "draft" / "checkpoint.pt", weights_only=True)["module"]
    target = load_target(trained / "target", torch.float32)
    reloaded = load_draft(trained / "draft", target, torch.float32).state_dict()
    assert reloaded.keys() == trained_state.keys()
    for name, tensor in trained_state.items():
        assert torch.equal(reloaded[name], tensor), name


def test_resume_continues_exactly(trained, tmp_path):
    recipe = replace(TINY_DRAFT, steps=6, num_prompts=8, gen_len=16)
    train_draft(trained / "target", tmp_path / "whole", recipe)
    train_draft(trained / "target", tmp_path / "split", recipe, stop_after=3)
    first_half = json.loads((tmp_path / "split" / "train_log.json").read_text())["summary"]["steps_done"]
    train_draft(trained / "target", tmp_path / "split", recipe, resume=True)
    assert first_half == 3
    whole = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    split = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)
    assert split["step"] == whole["step"] == 6
    for name, tensor in whole["module"].items():
        assert torch.equal(split["module"][name], tensor), name


def test_resume_without_checkpoint_is_a_clear_error(trained, tmp_path):
    shutil.copy(trained / "draft" / "draft_data.pt", tmp_path / "draft_data.pt")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train_draft(trained / "target", tmp_path, TINY_DRAFT, resume=True)


def test_ttt_unroll_equals_the_inference_chain():
    """Step i, row p of the unroll = prefilling rows 0..p-i with target features, then i own steps."""
    torch.manual_seed(0)
    config = ModelConfig.from_dict(llama3_config(64, hidden_size=32, intermediate_size=64))
    target = LlamaForCausalLM(config)
    draft = Eagle3Draft(draft_config_for(config, draft_vocab_size=40))
    with torch.no_grad():
        for p in [*target.parameters(), *draft.parameters()]:
            p.normal_(0.0, 0.3)
    draft.attach(target)
    t, steps = 12, 4
    tokens = torch.randint(0, 64, (1, t))
    aux = torch.randn(1, t, 3 * 32)
    with torch.no_grad():
        unrolled = ttt_unroll(draft, tokens, aux, steps)
        for step in range(steps):
            for p in range(step, t - 1):
                cache = KVCache(draft.config.layer, 1, 32, torch.float32, torch.device("cpu")).layers[0]
                start = p - step  # the last row with target features
                rows = torch.arange(start + 1)[None]
                h = draft(tokens[:, 1 : start + 2], draft.fuse(aux[:, : start + 1]), rows, cache, 0, 32)
                h = h[:, -1:]
                for position in range(start + 1, p + 1):
                    h = draft(
                        tokens[:, position + 1 : position + 2], h, torch.tensor([[position]]), cache, 0, 32
                    )
                torch.testing.assert_close(draft.logits(h)[0, 0], unrolled[step][0, p], atol=1e-5, rtol=1e-5)


def test_ttt_mask_worked_example():
    m = ttt_mask(4, 1, torch.device("cpu"))[0, 0].int()
    assert m.tolist() == [
        [0, 0, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1],
    ]


def test_draft_vocabulary_by_frequency():
    assert draft_vocabulary(torch.tensor([3, 3, 7, 1, 3, 7]), 10, 2).tolist() == [3, 7]
    assert draft_vocabulary(torch.tensor([5, 5]), 10, 3).tolist() == [0, 1, 5]


def test_load_texts_formats_and_errors(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "a"}\n{"prompt": "b"}\n{"messages": [{"role": "user", "content": "c"}]}\n')
    assert data.load_texts(jsonl) == ["a", "b", "c"]
    jsonl.write_text('{"text": "a"}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match="d.jsonl:2"):
        data.load_texts(jsonl)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_texts(tmp_path / "missing")


def test_train_target_is_deterministic_for_a_seed(tmp_path):
    recipe = replace(TINY_TARGET, steps=4)
    for name in ("a", "b"):
        train_target(tmp_path / name, recipe)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    other = replace(recipe, seed=1)
    train_target(tmp_path / "c", other)
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != (
        tmp_path / "a" / "model.safetensors"
    ).read_bytes()
