"""`redline eval --data humaneval | sharegpt`: tasks and perplexity texts from the built-in sets.

- humaneval: each problem is a code task (a base-style completion of the prompt, cut at HumanEval's
  stop sequences, then the problem's tests); perplexity is over prompt + canonical solution.
- sharegpt: each held-out conversation's first user turn (up to SHAREGPT_MAX_PROMPT_CHARS) is an
  "open" task (chat template, greedy agreement only); perplexity is over the held-out conversations
  rendered with the chat template.
"""

from __future__ import annotations

from redline.data import humaneval, sharegpt
from redline.evaluate.tasks import Task

HUMANEVAL_MAX_TOKENS = 512
SHAREGPT_MAX_TOKENS = 128
SHAREGPT_MAX_PROMPT_CHARS = 4000  # longer first turns are skipped (a few thousand tokens would not fit)


def humaneval_tasks() -> list[Task]:
    return [Task(p.task_id, "humaneval pass@1", "code", p.prompt, answer=None, tests=p.tests,
                 max_tokens=HUMANEVAL_MAX_TOKENS, stop=humaneval.STOP)
            for p in humaneval.problems()]  # fmt: skip


def sharegpt_tasks() -> list[Task]:
    return [Task(c.id, "sharegpt", "open", c.messages[0]["content"], answer=None, tests=None,
                 max_tokens=SHAREGPT_MAX_TOKENS, messages=c.messages[:1])
            for c in sharegpt.conversations("held_out")
            if len(c.messages[0]["content"]) <= SHAREGPT_MAX_PROMPT_CHARS]  # fmt: skip


def tasks(name: str) -> list[Task]:
    return {"humaneval": humaneval_tasks, "sharegpt": sharegpt_tasks}[name]()


def texts(name: str) -> list[str | sharegpt.Messages]:
    """Held-out text for perplexity: strings, or conversations to render with the chat template."""
    if name == "humaneval":
        return [p.prompt + p.canonical_solution for p in humaneval.problems()]
    return [c.messages for c in sharegpt.conversations("held_out")]
