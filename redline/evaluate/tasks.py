"""Task files with checkable answers, and their scoring.

One JSON object per line. Field names follow the public sets, so their files can be dropped in:
- prompt: "prompt", "question" or "problem";
- kind: "code" when there are "tests" (Python run after the completion in the sandbox, sandbox.py;
  pass = exit status 0 within the timeout), "choice" when there are "choices" (the answer is a
  letter, "A".."J"), else "math" (the answer is compared with the last number, or \\boxed{...},
  in the output);
- "answer" (math, choice), "tests" and optional "entry" (code), optional "max_tokens", "id", "task"
  (the column it is reported under; default: its kind).
Built-in sets (public_sets.py) add two fields: `stop` strings, and chat `messages` (rendered with the
model's chat template) for "open" tasks, which have no checkable answer: they only feed greedy agreement.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from redline.evaluate.sandbox import run_python

LETTERS = "ABCDEFGHIJ"
CODE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Task:
    id: str
    task: str  # reporting column
    kind: str  # "math" | "choice" | "code" | "open"
    prompt: str
    answer: str | None
    tests: str | None
    max_tokens: int
    stop: tuple[str, ...] = ()
    messages: tuple[dict[str, str], ...] | None = None  # a chat prompt, instead of the raw `prompt`


def load_tasks(path: Path) -> list[Task]:
    tasks = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e})") from e
        tasks.append(_task(record, f"{path}:{number}"))
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def _task(r: dict, where: str) -> Task:
    prompt = r.get("prompt") or r.get("question") or r.get("problem")
    if not isinstance(prompt, str):
        raise ValueError(f'{where}: needs a "prompt", "question" or "problem" string')
    kind = "code" if r.get("tests") else "choice" if r.get("choices") else "math"
    if kind == "choice":
        options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(r["choices"]))
        prompt = f"{prompt}\n{options}\nAnswer:"
    if kind != "code" and r.get("answer") is None:
        raise ValueError(f'{where}: a {kind} task needs an "answer"')
    return Task(id=str(r.get("id", where)), task=str(r.get("task", kind)), kind=kind, prompt=prompt,
                answer=None if r.get("answer") is None else str(r["answer"]), tests=r.get("tests"),
                max_tokens=int(r.get("max_tokens", 256)))  # fmt: skip


def normalize(value: str) -> str:
    """'1,024' -> '1024', '3.50' -> '3.5', '7.0' -> '7'; anything else stripped."""
    value = value.replace(",", "").strip()
    try:
        number = float(value)
    except ValueError:
        return value
    return str(int(number)) if number == int(number) else str(number)


def final_answer(text: str) -> str | None:
    """\\boxed{...} if present, else the last number: 'so x = 3.50.' -> '3.5'; none -> None."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    candidates = boxed or re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return normalize(candidates[-1]) if candidates else None


def chosen_letter(text: str) -> str | None:
    """The first standalone option letter: ' B. because' -> 'B'; '(c)' -> 'C'."""
    match = re.search(r"\b([A-J])\b", text.upper())
    return match.group(1) if match else None


def code_passes(completion: str, task: Task) -> bool:
    """Prompt + completion (or the completion's ```python block, when it has one) + tests, run in the
    sandbox with a timeout; passes when it exits with status 0."""
    blocks = re.findall(r"```(?:python)?\n(.*?)```", completion, flags=re.S)
    program = blocks[0] if blocks else task.prompt + completion
    return run_python(program + "\n\n" + (task.tests or "") + "\n", CODE_TIMEOUT_S)


def score(task: Task, completion: str) -> bool:
    if task.kind == "math":
        return final_answer(completion) == normalize(task.answer or "")
    if task.kind == "choice":
        return chosen_letter(completion) == (task.answer or "").strip().upper()[:1]
    if task.kind == "code":
        return code_passes(completion, task)
    raise ValueError(f"task {task.id}: an {task.kind!r} task has no checkable answer")
