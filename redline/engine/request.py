"""A request's life on the host: tokens in, stop conditions, text out, timing."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from redline.logprobs import TokenLogprob
from redline.sampling import SamplingParams
from redline.structured.rules import TokenRules
from redline.structured.token_controls import TokenBias
from redline.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from redline.tool_calls.formats import ToolCall


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or a stop string), "length", "cancelled", "error"; "tool_calls" (chat)
    prompt_tokens: int
    ttft_s: float  # arrival to first token
    latency_s: float  # arrival to last token
    tokens_per_s: float  # per user, decode phase: (tokens - 1) / (latency - ttft)
    acceptance_length: float | None = None  # speculation: mean tokens emitted per step that drafted
    acceptance_rates: list[float] | None = None  # per draft position: fraction of those steps accepting it
    decode_steps: int = 0  # steps after prefill that produced this completion's tokens
    draft_steps: int = 0  # those that verified drafts (the rest drafted nothing: engine/draft_length.py)
    preemptions: int = 0  # times its KV blocks were taken back and its tokens recomputed
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not computed)
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    logprobs: list[TokenLogprob] | None = None  # per generated token (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, None for the first
    tool_calls: list[ToolCall] | None = None  # LLM.chat with tools: the calls the output made

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)  # identity: the scheduler finds requests in its queue and slots
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    seed: int = 0
    num_draft_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    slot: int | None = None
    steps: int = 0  # decode steps taken
    draft_steps: int = 0  # of them, those that verified drafts
    preemptions: int = 0  # times the scheduler took its KV blocks back (it was prefilled again)
    prefill_ids: list[int] | None = None  # while it prefills: the tokens (prompt + outputs so far)
    computed: int = 0  # while it prefills: positions of prefill_ids in the cache (reused or computed)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache instead of computed
    accepted_at: list[int] = field(default_factory=list)  # per draft position: steps that accepted it
    group: object | None = None  # the n samples of one prompt share it (and, through the cache, its prefill)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of output_ids, with SamplingParams.logprobs
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # with .prompt_logprobs
    rules: TokenRules | None = None  # row masks: a grammar (structured outputs), bad words of several tokens
    bias: TokenBias | None = None  # logit_bias, allowed_token_ids, bad words of one token
    # with rules: the device's pending tokens and a tree's parents after the last plan (None: unknown)
    pending: tuple[list[int], list[int] | None] | None = None

    def __post_init__(self) -> None:
        self.seed = (self.params.seed if self.params.seed is not None else random.getrandbits(63)) & (
            2**63 - 1
        )
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        self._stops = StopStringMatcher(self.params.stop_strings)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """Absolute position of the newest token (the next forward's input)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    def record_step(self, n_acc: int, drafted: bool = True) -> None:
        """A decode step's result: n_acc drafts accepted, of drafts it verified (drafted) or none."""
        self.steps += 1
        self.draft_steps += drafted
        if n_acc > len(self.accepted_at):
            self.accepted_at.extend([0] * (n_acc - len(self.accepted_at)))
        for j in range(n_acc):
            self.accepted_at[j] += 1

    @property
    def prompt_logprobs_done(self) -> bool:
        """Whether every prompt token's log-probability is known (or none was asked for)."""
        return self.params.prompt_logprobs is None or len(self.prompt_logprobs) == len(self.prompt_ids)

    def add_prompt_logprobs(self, entries: list[TokenLogprob]) -> None:
        """A prefill chunk's prompt log-probabilities, in order (none for the first prompt token)."""
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)
        self.prompt_logprobs += entries

    def end_prefill_only(self) -> None:
        """max_tokens 0: the prompt's log-probabilities were all it asked for."""
        self.first_token_at = self.finished_at = time.perf_counter()
        self.finish_reason = "length"

    def accept(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> str:
        """Takes tokens emitted by one step, in order, up to the first stop, with their log-probabilities
        when the request asks for them; returns the new text."""
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        piece = ""
        for i, token in enumerate(tokens):
            self.output_ids.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            if self.rules is not None:
                self.rules.commit([token])
            if (token in self.eos_ids and not self.params.ignore_eos) or (self.rules and self.rules.done):
                self.finish_reason = "stop"
                piece += self._final_text()
                break
            text, stopped = self._stops.feed(self._detok.push(token))
            piece += text
            if stopped:
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
                piece += self._final_text()
                break
        self.text += piece
        if self.finished:
            self.finished_at = now
        return piece

    def _final_text(self) -> str:
        """Releases text held back for incomplete characters or possible stop strings."""
        text, stopped = self._stops.feed(self._detok.flush())
        return text if stopped else text + self._stops.flush()

    def cancel(self) -> None:
        if not self.finished:
            self.finish_reason = "cancelled"
            self.finished_at = time.perf_counter()

    def fail(self, message: str) -> None:
        """Ends the request with finish_reason "error" and `message` (nothing changes once finished)."""
        if not self.finished:
            self.finish_reason, self.error = "error", message
            self.finished_at = time.perf_counter()

    def completion(self) -> Completion:
        end = self.finished_at or time.perf_counter()
        first = self.first_token_at or end
        ttft = first - self.arrival
        latency = end - self.arrival
        decode_time = latency - ttft
        n = len(self.output_ids)
        return Completion(
            text=self.text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason or "length",
            prompt_tokens=len(self.prompt_ids),
            ttft_s=ttft,
            latency_s=latency,
            tokens_per_s=(n - 1) / decode_time if n > 1 and decode_time > 0 else float("nan"),
            decode_steps=self.steps,
            draft_steps=self.draft_steps,
            preemptions=self.preemptions,
            cached_tokens=self.cached_tokens,
            error=self.error,
            logprobs=None if self.params.logprobs is None else list(self.logprobs),
            prompt_logprobs=None if self.params.prompt_logprobs is None else list(self.prompt_logprobs),
            **self.acceptance(),
        )

    def acceptance(self) -> dict:
        """Acceptance length counts every token the steps that drafted produced (the bonus included), before
        stops cut; steps that drafted nothing (adaptive draft length) are left out."""
        if not self.steps or self.num_draft_tokens == 0:
            return {}
        if not self.draft_steps:
            return dict(acceptance_length=None, acceptance_rates=None)
        rates = [a / self.draft_steps for a in self.accepted_at] + [0.0] * (
            self.num_draft_tokens - len(self.accepted_at)
        )
        return dict(acceptance_length=1 + sum(rates), acceptance_rates=rates)


class GenerationError(RuntimeError):
    """Some requests failed. `completions` holds every prompt's result, in order; the failed ones have
    finish_reason "error" and their message in `error`."""

    def __init__(self, completions: Sequence[Completion]):
        self.completions = list(completions)
        failed = [c for c in self.completions if c.finish_reason == "error"]
        count = (
            ""
            if len(self.completions) == 1
            else f"{len(failed)} of {len(self.completions)} requests failed; "
        )
        super().__init__(f"{count}{failed[0].error}")
