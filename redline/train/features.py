"""What the draft trains on: the target's own sequences and its hidden states on them, as one packed
stream. Sequences are concatenated; `segments` says which sequence each position belongs to, and
training windows (`DraftData.windows`) are cut anywhere in the stream (ttt.py keeps attention and
chains inside a sequence).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

import torch
from tqdm import tqdm

from redline.models.llama import LlamaForCausalLM
from redline.train.loop import save_atomically


@dataclass(frozen=True)
class Sample:
    """A prompt and the target's response to it, in target tokens."""

    tokens: list[int]  # prompt + response
    prompt_len: int


@dataclass
class DraftData:
    tokens: torch.Tensor  # [N] int64, every sample's tokens, concatenated
    segments: torch.Tensor  # [N] int64 sample index
    responds: torch.Tensor  # [N] bool: the next token is a response token of the same sample
    aux: torch.Tensor  # [N, 3 * H] the target's aux hidden states
    final: torch.Tensor  # [N, H] the target's final normed hidden states
    vocab: torch.Tensor  # [V_draft] target ids of the draft vocabulary, ascending

    def save(self, path: Path) -> None:
        save_atomically({f.name: getattr(self, f.name) for f in fields(self)}, path)

    @classmethod
    def load(cls, path: Path) -> DraftData:
        return cls(**torch.load(path, weights_only=True))

    @property
    def num_sequences(self) -> int:
        return int(self.segments[-1]) + 1 if len(self.segments) else 0

    @cached_property
    def scored(self) -> torch.Tensor:  # [N] bool
        """Positions whose next-token distribution is trained on: the next token is a response token
        and in the draft vocabulary (EAGLE-3 skips positions whose target choice the draft cannot
        emit; with greedy regeneration the next token is the target's choice)."""
        in_vocab = torch.zeros(int(self.tokens.max()) + 1, dtype=torch.bool)
        in_vocab[self.vocab[self.vocab < len(in_vocab)]] = True
        following = torch.cat((self.tokens[1:], self.tokens[:1]))
        return self.responds & in_vocab[following]

    def windows(self, starts: list[int], length: int) -> dict[str, torch.Tensor]:
        """[B, length] slices of every stream tensor, one per start (aux and final: [B, length, ...])."""
        names = ("tokens", "segments", "scored", "aux", "final")
        return {k: torch.stack([getattr(self, k)[s : s + length] for s in starts]) for k in names}


def draft_vocabulary(tokens: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent ids in `tokens` (ties to the lower id), padded with the lowest unused
    ids when fewer occur, ascending: [3, 3, 7, 1, 3, 7], size 2 -> [3, 7]."""
    size = min(size, vocab_size)
    counts = Counter(tokens.flatten().tolist())
    ranked = sorted(counts, key=lambda i: (-counts[i], i))[:size]
    ranked += [i for i in range(vocab_size) if i not in counts][: size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.int64)


def responds_mask(samples: list[Sample]) -> torch.Tensor:
    """[N] bool over the concatenated samples: prompt [a b] + response [c d] -> [F T T F] (b predicts c,
    c predicts d; the last position's next token belongs to the next sample)."""
    flags = [s.prompt_len - 1 <= i < len(s.tokens) - 1 for s in samples for i in range(len(s.tokens))]
    return torch.tensor(flags, dtype=torch.bool)


@torch.inference_mode()
def extract(target: LlamaForCausalLM, samples: list[Sample], draft_vocab: int) -> DraftData:
    """Runs the target over every sample (its own dtype) for the aux and final hidden states; the draft
    vocabulary is the `draft_vocab` most frequent response tokens. The target is built with the aux
    layers the draft will read (models/eagle3.default_aux_layers)."""
    if not target.aux_layers:
        raise ValueError("extract needs a target built with aux_layers (the hidden states the draft reads)")
    aux, final = [], []
    for s in tqdm(samples, desc="target features", unit="seq", dynamic_ncols=True):
        hidden, captured = target(torch.tensor([s.tokens]), torch.arange(len(s.tokens))[None])
        aux.append(captured[0])
        final.append(hidden[0])
    responses = torch.tensor([t for s in samples for t in s.tokens[s.prompt_len :]], dtype=torch.int64)
    return DraftData(
        tokens=torch.tensor([t for s in samples for t in s.tokens], dtype=torch.int64),
        segments=torch.cat([torch.full((len(s.tokens),), i) for i, s in enumerate(samples)]),
        responds=responds_mask(samples),
        aux=torch.cat(aux),
        final=torch.cat(final),
        vocab=draft_vocabulary(responses, target.config.vocab_size, draft_vocab),
    )
