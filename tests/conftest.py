"""Tiny models built offline: a BPE tokenizer trained on the standard library, random HF checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on CPU (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# engines compile on CPU by default (runner/build.compiles); here only the tests that ask do
os.environ.setdefault("REDLINE_COMPILE", "0")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # `make test` runs a worker per core: the cores shared out
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))

from redline.train.bpe import train_bpe_tokenizer
from redline.train.data import stdlib_texts
from redline.train.draft import DraftRecipe, train_draft
from redline.train.target import TargetRecipe, train_target

VOCAB = 384


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(stdlib_texts(max_files=20, max_chars=10_000), VOCAB, out)
    return out


def llama3_hf_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=[1, 4],
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def llama4_hf_config(**overrides):
    from transformers import Llama4TextConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=48,  # experts and shared expert
        intermediate_size_mlp=112,  # dense layers
        num_hidden_layers=4,  # layers 0-2 RoPE + chunked, layer 3 NoPE; MoE on layers 1 and 3
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=24,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=0.5,
        max_position_embeddings=1024,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=[1, 4],
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    kw.update(overrides)
    return Llama4TextConfig(**kw)


def build_hf_model(config, seed: int | None = None):
    """A random HF model in fp32, eval mode. Expert tensors get the same init as everything else."""
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0.0, config.initializer_range)
    return model


def save_hf_model(model, out: Path, tokenizer_dir: Path, **save_kw) -> Path:
    model.save_pretrained(out, safe_serialization=True, **save_kw)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture
def without_cpu_kernels(monkeypatch):
    """No C++ CPU kernel for the test's models (neither AVX-512 BF16's nor AVX2's quantized product and
    decode attention): the paths a machine without them takes (torch's int4 kernel, dequantized int8 and
    GGUF weights, attention over the gathered cache)."""
    from redline.kernels import cpu_ops

    monkeypatch.setattr(cpu_ops, "load", lambda: False)
    monkeypatch.setattr(cpu_ops, "load_avx2", lambda: False)
    monkeypatch.setattr(cpu_ops, "_avx2_loaded", False)


@pytest.fixture
def llama3_dir(tmp_path, tokenizer_dir):
    model = build_hf_model(llama3_hf_config(tie_word_embeddings=True))
    return save_hf_model(model, tmp_path / "llama3", tokenizer_dir), model


def greedy_divergence_is_a_near_tie(
    model, prompt: list[int], a: list[int], b: list[int], atol: float = 1e-4, presence: float = 0.0,
    frequency: float = 0.0,
):  # fmt: skip
    """True when a == b, or when they first differ where `model`'s top-two logits (on a's prefix, with the
    presence and frequency penalties of a's tokens so far; no repetition penalty) are within atol: an fp32
    rounding tie that any two correct implementations may break differently."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            seq = torch.tensor([prompt + a[:i]])
            with torch.no_grad():
                hidden, _ = model(seq, torch.arange(seq.shape[1])[None])
                logits = model.logits(hidden)[0, -1]
                counts = torch.bincount(torch.tensor(a[:i], dtype=torch.int64), minlength=logits.shape[-1])
                logits = logits - frequency * counts - presence * (counts > 0)
                top2 = logits.topk(2).values
            gap = (top2[0] - top2[1]).item()
            print(f"greedy tokens first differ at {i} ({x} vs {y}), top-2 logit gap {gap:.3g}")
            return gap < atol
    return len(a) == len(b)


TINY_TARGET = TargetRecipe(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    seq_len=64, batch_size=8, steps=150, warmup=10,
)  # fmt: skip
TINY_DRAFT = DraftRecipe(
    draft_vocab=256, ttt_steps=3, num_prompts=48, prompt_len=24, gen_len=40, steps=100, warmup=10, lr=3e-3
)


@pytest.fixture(scope="session")
def tied_llama_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A random Llama 3 with tied embeddings (seed 0) as an HF checkpoint: the server tests' model."""
    hf = build_hf_model(llama3_hf_config(tie_word_embeddings=True), seed=0)
    return save_hf_model(hf, tmp_path_factory.mktemp("tied_llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """A tiny target trained on the standard library, and its draft trained by TTT."""
    root = tmp_path_factory.mktemp("trained")
    train_target(root / "target", TINY_TARGET)
    train_draft(root / "target", root / "draft", TINY_DRAFT)
    return root


def sharegpt_context(tokenizer, tokens: int) -> str:
    """ShareGPT conversations' text cut to `tokens` tokens of `tokenizer`: a real-size prompt's body."""
    from redline.data import sharegpt

    text = " ".join(m["content"] for c in sharegpt.conversations("train")[:40] for m in c.messages)
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:tokens])
