"""Benchmark prompts from the held-out sets, in a fixed order (HumanEval's, and ShareGPT's held-out
conversations sorted by id), skipping those that do not fit: the engine bench's (`redline bench --model
--data`), the serving bench's (`--url --dataset sharegpt`) and the fixed-length load sweep's (`--url`)."""

from __future__ import annotations

from dataclasses import dataclass

from redline.data import humaneval, sharegpt
from redline.tokenizer import Tokenizer
from redline.train import data

MAX_PROMPT_TOKENS = 1024
MIN_TOKENS = 4


@dataclass(frozen=True)
class Request:
    """One request for the server: a chat (messages) or a completion (text), and its max_tokens."""

    prompt: str | sharegpt.Messages
    max_tokens: int
    prompt_tokens: int = 0  # counted by the client's tokenizer; 0 when not counted
    ignore_eos: bool = False


ENGINE_SETS = ("sharegpt", "humaneval", "humaneval-comments")
COMMENTS_TASK = "Add comments to this Python code. Answer with the whole code.\n\n```python\n{}```"


def engine_prompts(tokenizer: Tokenizer, name: str, count: int) -> list[list[int]]:
    """The first `count` prompts of a held-out set with at most MAX_PROMPT_TOKENS tokens, as token ids:
    HumanEval's raw (a base-style completion), ShareGPT's first user turn in the model's chat template, or
    the repetitive set "humaneval-comments": each HumanEval function (prompt and canonical solution) asked
    back with comments added, in a chat turn, so most of the answer copies the prompt."""
    if name == "humaneval":
        encoded = (tokenizer.encode(p.prompt) for p in humaneval.problems())
    elif name == "sharegpt":
        encoded = (tokenizer.encode_chat(list(c.messages[:1])) for c in sharegpt.conversations("held_out"))
    elif name == "humaneval-comments":
        encoded = (
            tokenizer.encode_chat(
                [{"role": "user", "content": COMMENTS_TASK.format(p.prompt + p.canonical_solution)}]
            )
            for p in humaneval.problems()
        )
    else:
        raise ValueError(f"unknown data set {name!r}: expected {', '.join(ENGINE_SETS)}")
    prompts = []
    for ids in encoded:
        if len(ids) <= MAX_PROMPT_TOKENS:
            prompts.append(ids)
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} {name} prompts have at most {MAX_PROMPT_TOKENS} tokens")


def sharegpt_requests(
    tokenizer: Tokenizer, count: int, max_output_tokens: int, max_model_len: int | None, ignore_eos: bool
) -> list[Request]:
    """The first `count` held-out conversations that fit: the first user turn and, as max_tokens, the real
    first answer's length capped at `max_output_tokens`, both counted with the served model's tokenizer.
    As in vLLM's `bench serve`, a prompt or an answer under MIN_TOKENS is skipped, and so are prompts over
    MAX_PROMPT_TOKENS and requests that would not fit the server's context."""
    requests = []
    for c in sharegpt.conversations("held_out"):
        question, answer = c.messages[0], c.messages[1]["content"]
        prompt_tokens = len(tokenizer.encode_chat([question]))
        output_tokens = len(tokenizer.encode(answer, add_special_tokens=False))
        if min(prompt_tokens, output_tokens) < MIN_TOKENS or prompt_tokens > MAX_PROMPT_TOKENS:
            continue
        max_tokens = min(output_tokens, max_output_tokens)
        if max_model_len is not None and prompt_tokens + max_tokens > max_model_len:
            continue
        requests.append(Request((question,), max_tokens, prompt_tokens, ignore_eos))
        if len(requests) == count:
            return requests
    raise ValueError(
        f"only {len(requests)} held-out ShareGPT conversations fit (prompt of {MIN_TOKENS}.."
        f"{MAX_PROMPT_TOKENS} tokens, answer of {MIN_TOKENS}+, prompt + max_tokens <= {max_model_len})"
    )


def stdlib_requests(count: int, max_tokens: int, chars: int = 400) -> list[Request]:
    """`count` completions of `max_tokens` tokens each (ignore_eos) of `chars`-character prompts cut from
    the held-out standard-library files."""
    texts = data.split_stdlib()[1]
    cut = [texts[i % len(texts)][(i // len(texts)) * chars :][:chars] for i in range(count)]
    return [Request(text, max_tokens, ignore_eos=True) for text in cut]
