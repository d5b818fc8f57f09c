"""Response bodies of /v1/completions and /v1/chat/completions: whole, or as server-sent event chunks,
one or more choices, with logprobs in each API's own shape.

Completions: {"tokens": [text], "token_logprobs": [float | null], "top_logprobs": [{text: float} | null],
"text_offset": [int]}, a prompt's first token (echo) having null; offsets index the returned text, where
special tokens (a prompt's BOS) take no room. Chat: {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}]}. A token's text is its own decode (special tokens
kept), which may be part of a character: "bytes" are the token's own bytes (Tokenizer.token_bytes).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from redline.engine.request import Completion
from redline.engine.request import Request as EngineRequest
from redline.logprobs import TokenLogprob
from redline.tokenizer import Tokenizer
from redline.tool_calls.formats import ToolCall
from redline.tool_calls.tool_use import ToolStream, ToolUse


@dataclass
class Choice:
    """One choice of a response: sample `index` of the request's prompts x n."""

    index: int
    request: EngineRequest
    echo: str | None = None  # completions with echo: the prompt's text, before the completion's
    offset: int = 0  # streamed text so far (text_offset of the next token)
    started: bool = field(default=False, repr=False)  # a chunk of it was sent
    tools: ToolUse | None = None  # chat with tools: its output is read as content or calls
    tool_stream: ToolStream | None = field(default=None, repr=False)  # streamed: the text held back

    def __post_init__(self) -> None:
        if self.tools is not None:
            self.tool_stream = ToolStream(self.tools)


def usage(completions: list[Completion], choices: list[Choice]) -> dict:
    """Prompt tokens once per prompt (its n samples share it), completion tokens of every choice. A prompt's
    cached tokens are those none of its samples computed (the fewest any sample took from the cache)."""
    prompts: dict[int, list[Completion]] = {}
    for choice, completion in zip(choices, completions, strict=True):
        group = choice.request.group
        prompts.setdefault(id(group) if group is not None else id(choice), []).append(completion)
    prompt_tokens = sum(samples[0].prompt_tokens for samples in prompts.values())
    completion_tokens = sum(c.completion_tokens for c in completions)
    cached = sum(min(c.cached_tokens for c in samples) for samples in prompts.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


class Responder:
    """Builds the response bodies of one request, chat or text completion."""

    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def logprobs(self, choice: Choice, tokens: list[int], entries: list[TokenLogprob | None]) -> dict:
        """The logprobs object of `tokens` (entries aligned with them; None: a prompt's first token)."""
        if self.chat:
            item = lambda token, logprob: {"token": self._text(token), "logprob": logprob,
                                           "bytes": list(self.tokenizer.token_bytes(token))}  # fmt: skip
            return {"content": [item(e.token, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries if e is not None]}  # fmt: skip
        offsets = []
        for token in tokens:
            offsets.append(choice.offset)
            choice.offset += len(self.tokenizer.decode([token]))  # special tokens: none of the text
        return {
            "tokens": [self._text(t) for t in tokens],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {self._text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def full(self, choices: list[Choice], completions: list[Completion]) -> dict:
        bodies = []
        for choice, c in zip(choices, completions, strict=True):
            logprobs = None
            if c.logprobs is not None:
                tokens, entries = list(c.token_ids), list(c.logprobs)
                if choice.echo is not None and c.prompt_logprobs is not None:
                    tokens, entries = choice.request.prompt_ids + tokens, c.prompt_logprobs + entries
                logprobs = self.logprobs(choice, tokens, entries)
            reason = c.finish_reason
            if self.chat:
                content, calls = c.text, []
                if choice.tools is not None:
                    content, calls, reason = choice.tools.read(c.text, reason)
                message: dict = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = [call.openai() for call in calls]
                body = {"index": choice.index, "message": message, "logprobs": logprobs}
            else:
                body = {"index": choice.index, "text": (choice.echo or "") + c.text, "logprobs": logprobs}
            bodies.append(body | {"finish_reason": reason})
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, bodies) | {"usage": usage(completions, choices)}

    def chunk(self, choice: Choice, text: str | None, logprobs: dict | None = None,
              finish_reason: str | None = None, role: bool = False,
              calls: Sequence[ToolCall] = ()) -> str:  # fmt: skip
        """One choice's chunk; chat's may carry tool calls, each whole in its delta (OpenAI's shape, so
        clients that join arguments piece by piece join one piece)."""
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            if calls:
                delta["tool_calls"] = [{"index": i} | call.openai() for i, call in enumerate(calls)]
            content: dict = {"delta": delta}
        else:
            content = {"text": text or ""}
        body = {"index": choice.index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse(self._envelope(self.chunk_object, [body]))

    def usage_chunk(self, choices: list[Choice], completions: list[Completion]) -> str:
        return sse(self._envelope(self.chunk_object, []) | {"usage": usage(completions, choices)})


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
