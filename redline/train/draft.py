"""`redline train-draft`: an EAGLE-3 draft for any supported target.

1. Prompts: the first user turn of ShareGPT training conversations in the target's chat template, or
   windows cut from local text (default: the standard library's source). The target answers them
   itself through redline's engine (regenerate.py); answers are saved as they finish (OUT/samples.pt).
2. The target's aux and final hidden states on those sequences, packed with them into one stream
   (features.py, OUT/draft_data.pt); the target's distribution over the draft vocabulary is recomputed
   per batch from the final hidden states.
3. Training-time test (ttt.py) on random windows of the stream, bf16 autocast where bf16 is fast
   (precision.py), AdamW with warm-up, cosine decay, clipping and checkpoints (loop.py).
4. The result is saved in the published EAGLE-3 layout (`midlayer.*`, LlamaForCausalLMEagle3).

With `budget_minutes` the number of answers and of training steps are sized to the time (budget.py);
`resume=True` continues whatever stage an interrupted run reached in OUT.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from redline.config import ModelConfig
from redline.engine.llm import LLM
from redline.engine.request import Completion
from redline.models.build import load_target
from redline.models.eagle3 import Eagle3Draft, default_aux_layers, draft_config_for, save_draft
from redline.models.llama import LlamaForCausalLM
from redline.sampling import SamplingParams
from redline.tokenizer import Tokenizer
from redline.train import data
from redline.train.budget import Plan, plan_training, regen_deadline
from redline.train.draft_init import init_from_target
from redline.train.features import DraftData, Sample, extract
from redline.train.loop import Schedule, StepLoss, save_atomically, train
from redline.train.precision import autocast, compute_dtype
from redline.train.random_init import normal_init
from redline.train.regenerate import chat_prompts, regenerate
from redline.train.ttt import ttt_loss

SHAREGPT = "sharegpt"
STAGES = ("samples.pt", "draft_data.pt", "plan.json", "checkpoint.pt")  # what each stage leaves in OUT


@dataclass(frozen=True)
class DraftRecipe:
    """The demo's recipe (redline/demo.py); --budget-minutes runs it longer. ttt_steps 3 is what K = 3
    uses; prompts of at most 128 tokens keep the answers' KV short, so the target answers faster."""

    draft_vocab: int = 4096
    intermediate_size: int | None = None  # None: the target's
    ttt_steps: int = 3
    num_prompts: int = 512  # prompts the target answers (with a time budget: as many as fit)
    prompt_len: int = 64  # text data: the prompt window
    max_prompt_len: int = 128  # chat data: longer prompts are left out
    gen_len: int = 128  # most tokens per answer
    temperature: float = 0.0  # of the target's answers (regenerate.py says why greedy)
    regen_batch: int = 64  # engine slots while the target answers
    seq_len: int = 512  # training window over the packed stream
    batch_size: int = 4
    steps: int = 300  # with a time budget: as many as fit
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.0
    seed: int = 0
    init: str = "random"  # the layer's start: "random", or "target": its last layer (draft_init.py)


def source_prompts(
    source: str | Path | None, tokenizer: Tokenizer, recipe: DraftRecipe
) -> tuple[list[list[int]], list[str], bool]:
    """(prompts, where each came from, whether they are chat turns). ShareGPT: training conversations
    only, in a fixed shuffled order; text: `num_prompts` windows of `prompt_len` tokens."""
    if source == SHAREGPT:
        from redline.data.sharegpt import conversations

        pool = conversations("train")
        order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(recipe.seed)).tolist()
        pool = [pool[i] for i in order]
        chosen = chat_prompts(tokenizer, [c.messages for c in pool], recipe.max_prompt_len)
        return [ids for _, ids in chosen], [pool[i].id for i, _ in chosen], True
    texts = data.load_texts(Path(source)) if source is not None else data.split_stdlib()[0]
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    prompts = data.prompt_windows(encoded, recipe.num_prompts, recipe.prompt_len, recipe.seed)
    return prompts, [f"text window {i}" for i in range(len(prompts))], False


def answer_prompts(
    target_dir: Path, out: Path, recipe: DraftRecipe, source: str | Path | None, budget_s: float | None
) -> tuple[list[Sample], list[str], float]:
    """The target's answers, their sources, and the seconds earlier (interrupted) runs spent answering:
    OUT/samples.pt holds the answers finished so far and is continued."""
    path = out / "samples.pt"
    saved = torch.load(path, weights_only=True) if path.is_file() else {"samples": {}, "seconds": 0.0}
    prompts, sources, chat = source_prompts(source, Tokenizer.from_dir(target_dir), recipe)
    if budget_s is None:
        prompts = prompts[: recipe.num_prompts]
    llm = LLM(target_dir, dtype=compute_dtype(), max_num_seqs=recipe.regen_batch,
              max_model_len=max(map(len, prompts)) + recipe.gen_len + 8, compile=False)  # fmt: skip
    done = {i: Sample(tokens, prompt_len) for i, (tokens, prompt_len) in saved["samples"].items()}
    start = time.perf_counter()
    deadline = None if budget_s is None else regen_deadline(budget_s, saved["seconds"], start)

    params = lambda i: SamplingParams(  # text windows have no end: they run to gen_len
        max_tokens=recipe.gen_len, temperature=recipe.temperature, seed=recipe.seed + i, ignore_eos=not chat
    )

    def save() -> None:
        state = {
            "samples": {i: (s.tokens, s.prompt_len) for i, s in done.items()},
            "seconds": saved["seconds"] + time.perf_counter() - start,
            "sources": sources,
        }
        save_atomically(state, path)

    regenerate(llm, prompts, params, done, deadline, save)
    order = sorted(done)
    return [done[i] for i in order], [sources[i] for i in order], saved["seconds"]


def resumable(out: Path) -> bool:
    """Whether an interrupted run left a stage in `out` to continue from."""
    return any((out / name).is_file() for name in STAGES)


def new_draft(target: LlamaForCausalLM, recipe: DraftRecipe, vocab: torch.Tensor) -> Eagle3Draft:
    """Random layer (or the target's last, recipe.init "target"), lm_head initialised from the target's
    rows of the draft vocabulary."""
    if recipe.init not in ("random", "target"):
        raise ValueError(f'init must be "random" or "target", got {recipe.init!r}')
    torch.manual_seed(recipe.seed)
    config = draft_config_for(target.config, len(vocab), recipe.intermediate_size)
    draft = Eagle3Draft(config, target_embedding=target.model.embed_tokens)
    normal_init(draft)
    if recipe.init == "target":
        init_from_target(draft, target)
    with torch.no_grad():
        draft.lm_head.weight.copy_(target.lm_head.weight[vocab])
        draft.d2t.copy_(vocab - torch.arange(len(vocab)))
        draft.t2d.zero_()
        draft.t2d[vocab] = True
    return draft


def seconds_per_step(draft: Eagle3Draft, step_loss: StepLoss, repeats: int = 2) -> float:
    """One training step's time: forward and backward of the first batches after a warm-up one; the
    gradients are dropped, so the draft is unchanged."""
    times = []
    for step in range(repeats + 1):
        start = time.perf_counter()
        step_loss(step)[0].backward()
        times.append(time.perf_counter() - start)
    draft.zero_grad(set_to_none=True)
    # + 15% for the optimizer step, and for steps slowing down as a run goes on (BENCHMARKS.md, "The
    # demo's first run and its draft")
    return min(times[1:]) * 1.15


def train_draft(
    target_dir: Path,
    out: Path,
    recipe: DraftRecipe = DraftRecipe(),
    data_source: str | Path | None = None,  # "sharegpt", a path, or None: the standard library
    resume: bool = False,
    stop_after: int | None = None,
    budget_minutes: float | None = None,
) -> dict:
    """Trains and saves the draft under `out`; returns a summary (also in out/train_log.json)."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    if resume and not resumable(out):
        raise FileNotFoundError(f"--resume: nothing to resume in {out} (no samples, features or checkpoint)")
    if not resume:
        for name in STAGES:
            (out / name).unlink(missing_ok=True)
    budget_s = None if budget_minutes is None else 60.0 * budget_minutes
    features_path = out / "draft_data.pt"
    if features_path.is_file():
        features = DraftData.load(features_path)
        saved = torch.load(out / "samples.pt", weights_only=True)
        used = [saved["sources"][i] for i in sorted(saved["samples"])]
        earlier_s = saved["seconds"]  # answering and features of the interrupted run, at least
    else:
        samples, used, earlier_s = answer_prompts(target_dir, out, recipe, data_source, budget_s)
        layers = ModelConfig.from_dir(target_dir).num_layers
        traced = load_target(target_dir, compute_dtype(), aux_layers=default_aux_layers(layers))
        features = extract(traced, samples, recipe.draft_vocab)
        features.save(features_path)
    target = load_target(target_dir, torch.float32)
    target.requires_grad_(False)
    draft = new_draft(target, recipe, features.vocab)
    head_rows = target.lm_head.weight[features.vocab]  # [V_draft, H]
    length = min(recipe.seq_len, len(features.tokens))

    def step_loss(step: int) -> tuple[torch.Tensor, dict[str, float]]:
        gen = data.step_generator(recipe.seed, step)
        starts = torch.randint(0, len(features.tokens) - length + 1, (recipe.batch_size,), generator=gen)
        w = features.windows(starts.tolist(), length)
        with autocast():
            return ttt_loss(
                draft, w["tokens"], w["aux"], w["segments"], w["final"].to(head_rows.dtype), head_rows,
                w["scored"], recipe.ttt_steps,
            )  # fmt: skip

    steps, plan = recipe.steps, None
    if budget_s is not None:
        plan_path = out / "plan.json"
        if not plan_path.is_file():
            step_s = seconds_per_step(draft, step_loss)
            plan_training(budget_s, earlier_s + time.perf_counter() - start, step_s).save(plan_path)
        plan = Plan.load(plan_path)
        steps = plan.steps
    checkpoint = out / "checkpoint.pt"
    schedule = Schedule(steps, recipe.lr, min(recipe.warmup, steps // 10), recipe.weight_decay, clip=0.5,
                        save_every=50)  # fmt: skip
    log = train(draft, step_loss, schedule, checkpoint, checkpoint.is_file(), "train-draft", stop_after)
    save_draft(draft, out)
    tail = log[-20:]
    mean = lambda key: sum(e[key] for e in tail) / max(1, len(tail))
    summary = {
        "recipe": asdict(recipe),
        "data": str(data_source or "standard library"),
        "budget": asdict(plan) if plan else None,
        "sequences": features.num_sequences,
        "tokens": len(features.tokens),
        "scored_tokens": int(features.scored.sum()),
        "steps_done": len(log),
        "final_loss": mean("loss"),
        **{k: mean(k) for k in (tail[0] if tail else {}) if k.startswith("acc")},
    }
    (out / "train_log.json").write_text(json.dumps({"summary": summary, "sources": used, "log": log}))
    return summary


def acceptance_length(
    target_dir: Path, draft_dir: Path, prompts: list[list[int]], max_tokens: int, k: int = 3
) -> float:
    """Mean tokens emitted per decode step over greedy completions of `prompts` (every step drafting)."""
    llm = LLM(target_dir, dtype="float32", max_num_seqs=8, draft=draft_dir, num_speculative_tokens=k,
              max_model_len=max(map(len, prompts)) + max_tokens + 8, compile=False,
              adaptive_draft_length=False)  # fmt: skip
    completions = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return run_acceptance_length(completions)


def run_acceptance_length(completions: list[Completion]) -> float:
    """Tokens the decode steps that drafted produced per step, over all completions (each weighted by its
    steps)."""
    steps = sum(c.draft_steps for c in completions)
    produced = sum(c.draft_steps * (c.acceptance_length or 1.0) for c in completions)
    return produced / steps if steps else math.nan


def held_out_prompts(target_dir: Path, count: int, length: int, seed: int = 1) -> list[list[int]]:
    """Prompts cut from the demo corpus's held-out files, in the target's tokens."""
    tokenizer = Tokenizer.from_dir(target_dir)
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in data.split_stdlib()[1]]
    return data.prompt_windows(encoded, count, length, seed)
