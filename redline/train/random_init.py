"""Write a small randomly initialised Llama checkpoint in Hugging Face format.

Used by the tests and by `redline init-random` so every command can run without downloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from redline.config import ModelConfig
from redline.models.llama import LlamaForCausalLM
from redline.models.loader import save_weights
from redline.train.bpe import train_bpe_tokenizer
from redline.train.data import stdlib_texts


def llama3_config(vocab_size: int, **overrides) -> dict:
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=4,
        torch_dtype="float32",
    )
    return config | overrides


def normal_init(module: torch.nn.Module, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """N(0, std) weights from `generator` (default: the global one), norms set to 1."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)


def save_model(model: torch.nn.Module, config: dict, out: Path) -> None:
    """config.json + model.safetensors (without lm_head.weight when tied to the embeddings)."""
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight")
    save_weights(state, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def write_random_checkpoint(out_dir: str | Path, config: dict, seed: int = 0) -> None:
    """A model of `config` with N(0, 0.02) weights and unit norms, saved by save_model."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_dict(config))
    normal_init(model)
    save_model(model, config, out)


def write_random_model(out_dir: str | Path, vocab_size: int = 512, seed: int = 0, **overrides) -> Path:
    """A tokenizer trained on the standard library plus a random tiny Llama 3 over its vocabulary."""
    out = Path(out_dir)
    train_bpe_tokenizer(stdlib_texts(), vocab_size, out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    write_random_checkpoint(out, llama3_config(len(vocab), **overrides), seed)
    return out


def write_random_draft(
    target_dir: str | Path, out: str | Path, draft_vocab: int | None = None, seed: int = 0, std: float = 0.1
) -> Path:
    """A random EAGLE-3 draft for the target in `target_dir`; with draft_vocab, a random sub-vocabulary."""
    from redline.models.eagle3 import Eagle3Draft, draft_config_for, save_draft

    target = ModelConfig.from_dir(target_dir)
    gen = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(draft_config_for(target, draft_vocab))
    normal_init(draft, std, gen)
    with torch.no_grad():
        if draft_vocab:
            ids = torch.randperm(target.vocab_size, generator=gen)[:draft_vocab].sort().values
            draft.d2t.copy_(ids - torch.arange(draft_vocab))
            draft.t2d.zero_()
            draft.t2d[ids] = True
    save_draft(draft, out)
    return Path(out)
