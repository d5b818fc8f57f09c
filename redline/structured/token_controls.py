"""Token-level controls: logit_bias, allowed_token_ids and bad_words (OpenAI's and vLLM's), as a slot's
logit bias and, for bad words of several tokens, per-row masks.

What does not depend on the context is one bias row per slot (SamplingTensors.bias, set when the request
enters its slot): logit_bias's values, -inf off allowed_token_ids and on a bad word of one token. The
step adds it to the target's logits before the penalties and to the draft's through its vocabulary map,
so verification and the draft's proposals see the same distribution.

A bad word of several tokens is banned as vLLM bans it: its last token is masked where the output so far
ends with the rest of it. That depends on the row's context, the drafts before it included, so it is a
row mask computed on the host beside a grammar's (structured/rules.py).

Bad words are tokenized as vLLM does, at the start of the text and after a space: "hello world" gives the
token ids of "hello world" and of " hello world" (when that tokenization is another word's, not the same
tokens with a space token in front). Example with SmolLM2: "Paris" -> [48, 1165] and [7042]: " Paris" is
one token, banned everywhere; "Paris" is two, whose second is banned after the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redline.sampling import ParamError, SamplingParams
from redline.tokenizer import Tokenizer

INT32_BITS = 0xFFFFFFFF


@dataclass(frozen=True)
class TokenBias:
    """A slot's bias row as plain values (a plan travels to tensor-parallel ranks as such): `rest` for
    every token not in `ids` (0, or -inf under allowed_token_ids), values[i] for ids[i]."""

    rest: float
    ids: tuple[int, ...]
    values: tuple[float, ...]

    def dense(self, vocab_size: int) -> torch.Tensor:  # [V] fp32
        row = torch.full((vocab_size,), self.rest)
        row[list(self.ids)] = torch.tensor(self.values, dtype=torch.float32)
        return row


def bias_block(
    bias: torch.Tensor,  # [B, V] bias rows
    first: int,
    n: int,
) -> torch.Tensor:  # [B, N]
    """A tensor-parallel rank's block of the rows, tokens first .. first + N - 1, zeros past the vocabulary
    (a last block's padding): V 100 over 2 ranks of 51 -> rank 1 gets columns 51 .. 99 and one zero."""
    block = bias[:, first : first + n]
    return torch.nn.functional.pad(block, (0, n - block.shape[-1]))


def token_bias(params: SamplingParams, banned: set[int]) -> TokenBias | None:
    """The request's bias row (None: no control asks for one). allowed_token_ids [3, 5] with logit_bias
    {5: 2.0, 9: 1.0} and 3 banned: rest -inf, 3 -> -inf, 5 -> 2.0 (9 stays off: it is not allowed)."""
    bias, allowed = params.logit_bias or {}, params.allowed_token_ids
    if not bias and allowed is None and not banned:
        return None
    rest = 0.0 if allowed is None else float("-inf")
    values = dict.fromkeys(allowed or (), 0.0)
    values |= {t: float(v) for t, v in bias.items() if allowed is None or t in values}
    values |= dict.fromkeys(banned, float("-inf"))
    if allowed is not None and all(values[t] == float("-inf") for t in allowed):
        raise ParamError("allowed_token_ids", "every allowed token is a banned word")
    return TokenBias(rest, tuple(values), tuple(values.values()))


def bad_word_ids(tokenizer: Tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """Each word's token ids at the start of the text and after a space (vLLM's rule, above)."""
    found: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        found.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            found.append(spaced)
    return [ids for ids in dict.fromkeys(found) if ids]


class BadWords:
    """A request's bad words of several tokens: which last tokens each row may not emit."""

    def __init__(self, sequences: list[tuple[int, ...]]):
        self.sequences = [(ids[:-1], ids[-1]) for ids in sequences if len(ids) > 1]
        self.longest = max((len(prefix) for prefix, _ in self.sequences), default=0)
        self.recent: list[int] = []  # the output's last tokens, as many as the longest prefix

    def __bool__(self) -> bool:
        return bool(self.sequences)

    def commit(self, tokens: list[int]) -> None:
        combined = self.recent + tokens
        self.recent = combined[max(0, len(combined) - self.longest) :]

    def restrict(self, row: int, after: list[int], out: torch.Tensor) -> None:
        """Clears in out[row] ([T, W] int32) the last token of every bad word whose other tokens end the
        output followed by `after` (the drafts on the row's path)."""
        context = self.recent + after
        for prefix, last in self.sequences:
            if len(context) >= len(prefix) and tuple(context[len(context) - len(prefix) :]) == prefix:
                clear_bit(out, row, last)


def clear_bit(out: torch.Tensor, row: int, token: int) -> None:
    """Disallows `token` in out[row]: token 37 clears bit 5 of word 1 (structured/bitmask.py's layout).
    Words are int32: bit 31 set reads negative, so the word goes through its unsigned value and back."""
    word = int(out[row, token // 32]) & INT32_BITS
    word &= ~(1 << (token % 32)) & INT32_BITS
    out[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
