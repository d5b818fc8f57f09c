"""`--budget-minutes`: what a time budget buys for a draft, measured on the machine it runs on.

The target answers prompts for REGEN_SHARE of the budget (no request starts after that deadline, and
the ones in flight keep their partial responses), its hidden states on those sequences are extracted,
and training gets the rest: steps = time left / the measured time of one step, fixed before step 0
(the learning-rate schedule needs it) and saved in plan.json so that a resumed run is the same run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REGEN_SHARE = 0.4  # of the budget, for the target's answers (features take about a quarter of that)
RESERVE_S = 10.0  # saving the draft and its log
MIN_STEPS = 10


@dataclass(frozen=True)
class Plan:
    budget_s: float
    spent_s: float  # before training: loading, the target's answers, features, calibration
    step_s: float  # one training step, measured
    steps: int

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Plan:
        return cls(**json.loads(path.read_text()))


def regen_deadline(budget_s: float, already_s: float, now: float | None = None) -> float:
    """perf_counter() time at which the target stops starting answers, given `already_s` seconds of
    answering done by an earlier (interrupted) run."""
    now = time.perf_counter() if now is None else now
    return now + REGEN_SHARE * budget_s - already_s


def plan_training(budget_s: float, spent_s: float, step_s: float) -> Plan:
    """Steps that fit in what is left of the budget: budget 600 s, 250 s spent, 2 s a step -> 170
    (10 s kept for saving); never fewer than MIN_STEPS."""
    steps = int((budget_s - spent_s - RESERVE_S) / step_s)
    return Plan(budget_s, spent_s, step_s, max(MIN_STEPS, steps))
