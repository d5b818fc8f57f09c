"""`redline train-target`: the demo recipe. A byte-level BPE tokenizer and a small Llama trained from
scratch on the standard library's source (data.HELD_OUT excluded), written as a Hugging Face directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json) that transformers loads as well as redline. Deterministic for a seed."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from redline.config import ModelConfig
from redline.models.llama import LlamaForCausalLM
from redline.tokenizer import Tokenizer
from redline.train import data
from redline.train.bpe import train_bpe_tokenizer
from redline.train.loop import Schedule, train
from redline.train.random_init import llama3_config, normal_init, save_model


@dataclass(frozen=True)
class TargetRecipe:
    """The demo target (its size and training time: BENCHMARKS.md, "The demo pair")."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 260
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    seed: int = 0


def causal_lm_loss(model: LlamaForCausalLM, window: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over a batch of token windows [B, T + 1]."""
    inputs, labels = window[:, :-1], window[:, 1:]
    positions = torch.arange(inputs.shape[1])[None].expand_as(inputs)
    hidden, _ = model(inputs, positions)
    return F.cross_entropy(model.logits(hidden).flatten(0, 1), labels.flatten())


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss over consecutive windows (at most 64) of the held-out stream."""
    count = min(64, (len(stream) - 1) // seq_len)
    windows = (stream[i * seq_len : (i + 1) * seq_len + 1][None] for i in range(count))
    return sum(causal_lm_loss(model, w).item() for w in windows) / count


def train_target(out: Path, recipe: TargetRecipe = TargetRecipe(), resume: bool = False) -> dict:
    """Trains and writes the model; returns a summary (also written to out/train_log.json)."""
    torch.manual_seed(recipe.seed)
    train_texts, held_out_texts = data.split_stdlib()
    if not (resume and (out / "tokenizer.json").is_file()):
        train_bpe_tokenizer(train_texts, recipe.vocab_size, out)
    tokenizer = Tokenizer.from_dir(out)
    config = llama3_config(
        tokenizer.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
    )
    eos = config["eos_token_id"]
    stream = data.token_stream([tokenizer.encode(t) for t in train_texts], eos)
    held_out = data.token_stream([tokenizer.encode(t) for t in held_out_texts], eos)
    model = LlamaForCausalLM(ModelConfig.from_dict(config))
    _init_weights(model, recipe.num_layers)

    def step_loss(step: int) -> tuple[torch.Tensor, dict[str, float]]:
        gen = data.step_generator(recipe.seed, step)
        windows = data.stream_windows(stream, recipe.batch_size, recipe.seq_len + 1, gen)
        return causal_lm_loss(model, windows), {}

    schedule = Schedule(recipe.steps, recipe.lr, recipe.warmup, recipe.weight_decay, save_every=200)
    log = train(model, step_loss, schedule, out / "checkpoint.pt", resume, desc="train-target")
    eval_loss = held_out_loss(model, held_out, recipe.seq_len)
    save_model(model, config, out)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    summary = {
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": len(stream),
        "held_out_files": list(data.HELD_OUT),
        "final_train_loss": sum(e["loss"] for e in log[-20:]) / len(log[-20:]),
        "held_out_loss": eval_loss,
        "held_out_perplexity": math.exp(eval_loss),
    }
    (out / "train_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))
    return summary


def _init_weights(model: LlamaForCausalLM, num_layers: int) -> None:
    """N(0, 0.02) weights with output projections scaled by 1/sqrt(2 L) (GPT-2), unit norms."""
    normal_init(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.div_(math.sqrt(2 * num_layers))
    model.finish_loading()
