"""The optimisation loop both trainers share: AdamW, linear warm-up then cosine decay to 10%, gradient
clipping, a tqdm bar with loss and ETA, and a checkpoint (weights + optimizer + step + log) that
`resume=True` continues from. Batches are a function of the step (data.step_generator), so a
resumed run computes exactly what an uninterrupted one does."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm


@dataclass(frozen=True)
class Schedule:
    steps: int
    lr: float
    warmup: int = 0
    weight_decay: float = 0.0
    clip: float = 1.0
    save_every: int = 0  # steps between checkpoints; 0 saves at the end only

    def lr_at(self, step: int) -> float:
        """warmup 10, steps 110, lr 1e-3: step 4 -> 5e-4, step 10 -> 1e-3, step 109 -> ~1e-4."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


StepLoss = Callable[[int], tuple[torch.Tensor, dict[str, float]]]  # step -> (loss, metrics to show)


def train(
    module: nn.Module,
    step_loss: StepLoss,
    schedule: Schedule,
    checkpoint: Path,
    resume: bool = False,
    desc: str = "training",
    stop_after: int | None = None,  # end (with a checkpoint) after this many steps of this call
) -> list[dict[str, float]]:
    """Trains the module's parameters that require grad; returns the log (one dict per step)."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": schedule.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=schedule.lr, betas=(0.9, 0.95))
    start, log = 0, []
    if resume:
        if not checkpoint.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {checkpoint}")
        state = torch.load(checkpoint, weights_only=True)
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        start, log = state["step"], state["log"]
    end = schedule.steps if stop_after is None else min(schedule.steps, start + stop_after)
    bar = tqdm(total=schedule.steps, initial=start, desc=desc, unit="step", dynamic_ncols=True)
    module.train()
    for step in range(start, end):
        lr = schedule.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, metrics = step_loss(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, schedule.clip)
        optimizer.step()
        log.append({"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(), **metrics})
        bar.set_postfix(loss=f"{loss.item():.3f}", **{k: f"{v:.3f}" for k, v in metrics.items()})
        bar.update(1)
        if schedule.save_every and (step + 1) % schedule.save_every == 0 and step + 1 < end:
            _save(checkpoint, module, optimizer, step + 1, log)
    bar.close()
    module.eval()
    _save(checkpoint, module, optimizer, end, log)
    return log


def _save(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer, step: int, log: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"module": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "log": log}
    save_atomically(state, path)


def save_atomically(state: object, path: Path) -> None:
    """torch.save to a temporary name, then a rename: an interrupted save never leaves a torn file."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
