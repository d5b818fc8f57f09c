"""`redline train-draft`: an EAGLE-3 draft for any supported target.

1. Prompts come from local text (JSONL, a file or a directory; by default the demo corpus), and the
   target itself generates the continuations the draft learns (redline's engine, batched).
2. The draft vocabulary is the `draft_vocab` most frequent tokens of those sequences (d2t / t2d).
3. The target's aux hidden states and final hidden states are computed once per sequence and cached
   with the sequences in OUT/draft_data.pt; the target's distribution over the draft vocabulary is
   recomputed per batch from the final hidden states (its lm_head rows are fixed).
4. Training-time test (ttt.py) with AdamW, warm-up, cosine decay, clipping, checkpoints and --resume.
5. The result is saved in the published EAGLE-3 layout (`midlayer.*`, LlamaForCausalLMEagle3).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from redline.engine.llm import LLM
from redline.engine.request import Completion
from redline.models.build import load_target
from redline.models.eagle3 import Eagle3Draft, default_aux_layers, draft_config_for, save_draft
from redline.models.llama import LlamaForCausalLM
from redline.models.random_init import normal_init
from redline.sampling import SamplingParams
from redline.tokenizer import Tokenizer
from redline.train import data
from redline.train.loop import Schedule, train
from redline.train.ttt import ttt_loss


@dataclass(frozen=True)
class DraftRecipe:
    draft_vocab: int = 1024
    intermediate_size: int | None = None  # None: the target's
    ttt_steps: int = 7
    num_prompts: int = 256
    prompt_len: int = 64
    gen_len: int = 128
    temperature: float = 0.0  # of the target's continuations
    batch_size: int = 8
    steps: int = 300
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.0
    seed: int = 0


@dataclass
class DraftData:
    tokens: torch.Tensor  # [N, T] prompt + the target's continuation
    aux: torch.Tensor  # [N, T, 3 * H] the target's aux hidden states
    final: torch.Tensor  # [N, T, H] the target's final normed hidden states
    vocab: torch.Tensor  # [V_draft] target ids of the draft vocabulary, ascending

    def save(self, path: Path) -> None:
        torch.save({"tokens": self.tokens, "aux": self.aux, "final": self.final, "vocab": self.vocab}, path)

    @classmethod
    def load(cls, path: Path) -> DraftData:
        return cls(**torch.load(path, weights_only=True))


def draft_vocabulary(tokens: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent ids in `tokens` (ties to the lower id), padded with the lowest unused
    ids when fewer occur, ascending: [3, 3, 7, 1, 3, 7], size 2 -> [3, 7]."""
    size = min(size, vocab_size)
    counts = Counter(tokens.flatten().tolist())
    ranked = sorted(counts, key=lambda i: (-counts[i], i))[:size]
    unused = (i for i in range(vocab_size) if i not in counts)
    while len(ranked) < size:
        ranked.append(next(unused))
    return torch.tensor(sorted(ranked), dtype=torch.int64)


def generate_data(target_dir: Path, texts: list[str], recipe: DraftRecipe) -> DraftData:
    """The target completes prompts cut from `texts`; its hidden states on the results are the features."""
    llm = LLM(target_dir, dtype="float32", max_batch=16, max_seq_len=recipe.prompt_len + recipe.gen_len + 8)
    encoded = [llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    prompts = data.prompt_windows(encoded, recipe.num_prompts, recipe.prompt_len, recipe.seed)
    params = [
        SamplingParams(max_tokens=recipe.gen_len, temperature=recipe.temperature, ignore_eos=True, seed=i)
        for i in range(len(prompts))
    ]
    sequences = []
    bar = tqdm(total=len(prompts), desc="target generates", unit="seq", dynamic_ncols=True)
    for start in range(0, len(prompts), 64):  # chunks, so the bar moves
        chunk = slice(start, start + 64)
        for prompt, c in zip(prompts[chunk], llm.generate(prompts[chunk], params[chunk]), strict=True):
            sequences.append(prompt + c.token_ids)
        bar.update(len(prompts[chunk]))
    bar.close()
    length = min(len(s) for s in sequences)
    tokens = torch.tensor([s[:length] for s in sequences])
    target = llm.model
    target.aux_layers = default_aux_layers(target.config.num_layers)
    aux, final = [], []
    with torch.inference_mode():
        for rows in tqdm(tokens.split(16), desc="target features", unit="batch", dynamic_ncols=True):
            positions = torch.arange(rows.shape[1])[None].expand_as(rows)
            hidden, captured = target(rows, positions)
            aux.append(captured)
            final.append(hidden)
    vocab = draft_vocabulary(tokens, target.config.vocab_size, recipe.draft_vocab)
    return DraftData(tokens, torch.cat(aux), torch.cat(final), vocab)


def new_draft(target: LlamaForCausalLM, recipe: DraftRecipe, vocab: torch.Tensor) -> Eagle3Draft:
    """Random layer, lm_head initialised from the target's rows of the draft vocabulary."""
    torch.manual_seed(recipe.seed)
    draft = Eagle3Draft(draft_config_for(target.config, len(vocab), recipe.intermediate_size))
    normal_init(draft)
    with torch.no_grad():
        draft.lm_head.weight.copy_(target.lm_head.weight[vocab])
        draft.d2t.copy_(vocab - torch.arange(len(vocab)))
        draft.t2d.zero_()
        draft.t2d[vocab] = True
    draft.attach(target)
    return draft


def train_draft(
    target_dir: Path,
    out: Path,
    recipe: DraftRecipe = DraftRecipe(),
    data_path: Path | None = None,
    resume: bool = False,
    stop_after: int | None = None,
) -> dict:
    """Trains and saves the draft under `out`; returns a summary (also in out/train_log.json)."""
    out.mkdir(parents=True, exist_ok=True)
    cached = out / "draft_data.pt"
    if resume and cached.is_file():
        features = DraftData.load(cached)
    else:
        texts = data.load_texts(data_path) if data_path is not None else data.split_stdlib()[0]
        features = generate_data(target_dir, texts, recipe)
        features.save(cached)
    target = load_target(target_dir, torch.float32)
    target.requires_grad_(False)
    draft = new_draft(target, recipe, features.vocab)
    head_rows = target.lm_head.weight[features.vocab]  # [V_draft, H]

    def step_loss(step: int) -> tuple[torch.Tensor, dict[str, float]]:
        gen = data.step_generator(recipe.seed, step)
        pick = torch.randint(0, len(features.tokens), (recipe.batch_size,), generator=gen)
        target_probs = torch.softmax(features.final[pick] @ head_rows.T, dim=-1)
        return ttt_loss(draft, features.tokens[pick], features.aux[pick], target_probs, recipe.ttt_steps)

    schedule = Schedule(recipe.steps, recipe.lr, recipe.warmup, recipe.weight_decay, clip=0.5, save_every=50)
    log = train(draft, step_loss, schedule, out / "checkpoint.pt", resume, "train-draft", stop_after)
    save_draft(draft, out)
    tail = log[-20:]
    summary = {
        "recipe": asdict(recipe),
        "sequences": len(features.tokens),
        "sequence_tokens": features.tokens.shape[1],
        "steps_done": len(log),
        "final_loss": sum(e["loss"] for e in tail) / max(1, len(tail)),
        **{
            k: sum(e[k] for e in tail) / max(1, len(tail))
            for k in (tail[0] if tail else {})
            if k.startswith("acc")
        },
    }
    (out / "train_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))
    return summary


def acceptance_length(
    target_dir: Path, draft_dir: Path, prompts: list[list[int]], max_tokens: int, k: int = 3
) -> float:
    """Mean tokens emitted per decode step over greedy completions of `prompts`."""
    llm = LLM(target_dir, dtype="float32", max_batch=8, draft=draft_dir, num_draft_tokens=k,
              max_seq_len=max(map(len, prompts)) + max_tokens + 8)  # fmt: skip
    completions = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return run_acceptance_length(completions)


def run_acceptance_length(completions: list[Completion]) -> float:
    """Tokens the decode steps produced per step, over all completions (each weighted by its steps)."""
    steps = sum(c.decode_steps for c in completions)
    produced = sum(c.decode_steps * (c.acceptance_length or 1.0) for c in completions)
    return produced / steps if steps else math.nan


def held_out_prompts(target_dir: Path, count: int, length: int, seed: int = 1) -> list[list[int]]:
    """Prompts cut from the demo corpus's held-out files, in the target's tokens."""
    tokenizer = Tokenizer.from_dir(target_dir)
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in data.split_stdlib()[1]]
    return data.prompt_windows(encoded, count, length, seed)
