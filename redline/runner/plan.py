"""What the scheduler asks of the runner each step (StepPlan), what it gets back (StepResult), and the
shapes both must agree on (Shapes). Plain, picklable values: under tensor parallelism rank 0 sends each
plan to every rank once per step (runner/ranks.py).

A plan is applied in order: slots released (their requests left), block-table rows written, slots set up
for new requests (sampling parameters, penalty counts), structured outputs' token masks, one prefill
forward, one decode step, and the pending tokens of the slots in read_pending read back. A request whose
final prefill chunk runs in a plan decodes in the same plan: the prefill leaves its slot ready (pending
token, position), and the decode step reads it; one with a grammar decodes from the next plan on
(TokenMask).

Example: slot 2 finished last step; a 40-token prompt joins slot 2 with blocks 7, 8, 9 (40 tokens plus a
step's lookahead); slots 0 and 1 decode at positions 90 and 17:
    StepPlan(released=(2,), tables=(TableUpdate(2, 0, (7, 8, 9)),), admitted=(SlotSetup(2, ...),),
             prefill=PrefillBatch((PrefillChunk(2, prompt, 0, True, 0, ...),), logits=False),
             decode=DecodeBatch(rows=4, kv_len=128, logits=False, logprobs={}))
Slot 2 decodes too (from position 40); slot 3 is free: its row computes in the scratch block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from redline.draft_tree import TreeShape
from redline.kernels.paged_kv import BLOCK, kv_bucket
from redline.logprobs import TokenLogprob
from redline.sampling import SamplingParams
from redline.speculative.ngram import NgramRange
from redline.structured.token_controls import TokenBias

ALIGN = 16  # prefill rows are padded to a multiple of this


def padded_len(n: int, cache_len: int) -> int:
    """A prefill row's padded length: 5 -> 16, 20 -> 32, 33 -> 48; capped at cache_len."""
    return min(max(ALIGN, -(-n // ALIGN) * ALIGN), cache_len)


class SlotSampling(NamedTuple):
    """A request's sampling parameters as the device holds them (sampling.SamplingTensors' row)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence: float
    frequency: float
    repetition: float
    seed: int  # 32-bit

    @classmethod
    def of(cls, params: SamplingParams, seed: int) -> SlotSampling:
        p = params
        return cls(p.temperature, p.top_k, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                   p.repetition_penalty, (seed ^ (seed >> 32)) & 0xFFFFFFFF)  # fmt: skip


@dataclass(frozen=True)
class SlotSetup:
    """A request entering a slot (new, or back after a preemption)."""

    slot: int
    sampling: SlotSampling
    tokens: tuple[int, ...] | None = None  # prompt + outputs so far: penalized requests, n-gram lookup
    prompt_len: int = 0  # tokens[:prompt_len] is the prompt
    bias: TokenBias | None = None  # logit_bias, allowed_token_ids, bad words of one token (None: none)


@dataclass(frozen=True)
class TableUpdate:
    """Blocks `blocks` at entries start, start + 1, ... of the slot's block table."""

    slot: int
    start: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class PrefillChunk:
    """Positions [start, start + len(tokens)) of one slot's sequence (its prompt, or prompt + outputs when
    a preempted request comes back)."""

    slot: int
    tokens: tuple[int, ...]
    start: int
    final: bool  # the chunk that ends the sequence: its last row gives the first new token
    next_token: int = 0  # the token at start + len(tokens) (not final: the next chunk's first)
    decodes: bool = True  # final: the slot decodes in this plan after its first token (not when that is
    # all it asked, nor with a grammar: it starts with its first TokenMask)
    logprobs: int | None = None  # final: report the first token's logprob with the top N
    prompt_logprobs: int | None = None  # report the logprobs of the prompt tokens after each row (top N)
    prompt_len: int = 0  # with prompt_logprobs: positions [0, prompt_len) are the prompt

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class PrefillBatch:
    chunks: tuple[PrefillChunk, ...]
    logits: bool  # first tokens through the logits path (some request samples, is penalized, or logprobs)


@dataclass(frozen=True)
class DecodeBatch:
    rows: int  # slots [0, rows): a batch bucket
    kv_len: int  # a kv bucket covering every row's writes
    logits: bool  # the logits path: some row samples, is penalized or reports logprobs
    logprobs: dict[int, int] = field(default_factory=dict)  # slot -> top N, for slots reporting logprobs
    k: int | None = None  # drafts the step verifies: one of Shapes.variants (None: K)


@dataclass(frozen=True)
class TokenMask:
    """A structured-output slot's allowed tokens for the rows this plan runs (structured/matcher.py): a
    final prefill chunk's first token (one row), or a decode step's k + 1 rows (a tree's N). A slot that
    follows a grammar does not decode in the plan of its final chunk (its masks need the first token):
    its first decode step's mask sets it decoding (`decodes`)."""

    slot: int
    rows: int  # T
    bits: bytes  # [T, W] int32, as bytes (a plan travels to tensor-parallel ranks as plain values)
    decodes: bool  # a decode step's rows: the slot decodes in this plan

    @classmethod
    def of(cls, slot: int, bits: torch.Tensor, decodes: bool) -> TokenMask:  # bits [T, W] int32
        return cls(slot, bits.shape[0], bits.numpy().tobytes(), decodes)

    def tensor(self) -> torch.Tensor:  # [T, W] int32
        return torch.frombuffer(bytearray(self.bits), dtype=torch.int32).view(self.rows, -1)


@dataclass(frozen=True)
class StepPlan:
    released: tuple[int, ...] = ()
    tables: tuple[TableUpdate, ...] = ()
    admitted: tuple[SlotSetup, ...] = ()
    prefill: PrefillBatch | None = None
    decode: DecodeBatch | None = None
    masks: tuple[TokenMask, ...] = ()  # applied after the set-ups
    read_pending: tuple[int, ...] = ()  # slots whose pending tokens come back (their next masks need them)

    @property
    def empty(self) -> bool:
        parts = (self.released, self.tables, self.admitted, self.prefill, self.decode, self.masks,
                 self.read_pending)  # fmt: skip
        return not any(parts)


@dataclass
class ChunkResult:
    first: int | None  # a final chunk's first generated token
    logprob: TokenLogprob | None = None  # its log-probability, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # of the prompt tokens after each of the chunk's rows


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # per row of the batch: its K + 1 emitted tokens, the first n_acc + 1 new
    accepted: list[int]  # per row: n_acc, drafts accepted
    logprobs: dict[int, list[TokenLogprob]]  # slots reporting logprobs: their n_acc + 1 new tokens'
    k: int  # the drafts the step verified
    seconds: float | None = None  # the step's wall time, launch to result, when no prefill shared its plan
    runner: int = 0  # which runner ran it (its id: a compiled twin takes over from an eager runner)


@dataclass
class StepResult:
    prefill: list[ChunkResult] = field(default_factory=list)  # per chunk of plan.prefill
    decode: DecodeResult | None = None
    # plan.read_pending's slots: their pending tokens after the plan, and a draft tree's parents
    pending: dict[int, tuple[list[int], list[int] | None]] = field(default_factory=dict)


class StageError(RuntimeError):
    """A stage of a plan raised (`__cause__` is why). stage: "setup", "prefill" or "decode step";
    prefill: what an earlier prefill stage gave, when the decode step failed."""

    def __init__(self, stage: str, prefill: list[ChunkResult] | None = None):
        super().__init__(stage)
        self.stage, self.prefill = stage, prefill


@dataclass(frozen=True)
class Shapes:
    """The shapes every step runs at, known when the engine is built: slots, context, draft length K, with
    n-gram lookup the suffix lengths it tries (the runner then keeps every slot's tokens), and whether
    steps may verify no drafts (adaptive draft length: a second variant of the step, k = 0).

    A step writes up to `reach` positions past its pending token: the target's K verified rows, the
    draft's chain 2K - 1 (a draft tree: TreeShape.reach). A slot holds blocks for positions
    [0, position + lookahead) and the cache has room for max_len + reach + 2 positions.
    """

    slots: int
    max_len: int  # prompt + output tokens of a request
    k: int  # draft tokens per step (0: plain decoding)
    ngram: NgramRange | None = None  # n-gram lookup drafts (alone, or beside an EAGLE-3 draft)
    adaptive: bool = False  # steps of k = 0 beside k = K (engine/draft_length.py)
    tree: TreeShape | None = None  # EAGLE-2-style draft trees (speculative/tree.py): K = tree.steps

    @property
    def variants(self) -> tuple[int, ...]:
        """The drafts a step may verify: (0, K) adaptive, else (K,)."""
        return (0, self.k) if self.adaptive and self.k > 0 else (self.k,)

    @property
    def reach(self) -> int:
        """Positions past the pending token a step writes, 2K - 1 for the chain (plain decoding, K = 0: -1, as
        the arithmetic below wants; it writes the pending token's own position only)."""
        return self.tree.reach if self.tree is not None else 2 * self.k - 1

    @property
    def cache_len(self) -> int:
        return self.max_len + self.reach + 2

    @property
    def lookahead(self) -> int:
        return self.reach + 3

    def batch_bucket(self, rows_needed: int) -> int:
        """Rows a step runs over: the next power of two (1, 2, 4, ...), at most `slots`. 3 -> 4."""
        rows = 1
        while rows < rows_needed:
            rows *= 2
        return min(rows, self.slots)

    def kv_len_for(self, last_position: int) -> int:
        """Keys a step must see when the furthest slot's pending token sits at last_position."""
        return kv_bucket(last_position + self.reach + 2, self.cache_len)

    def prefill_len(self, n: int) -> int:
        return padded_len(n, self.cache_len)

    def blocks_for(self, positions: int) -> int:
        return -(-min(positions, self.cache_len) // BLOCK)

    def step_keys(self) -> list[tuple[int, int, bool, int]]:
        """Every (rows, kv_len, logits, k) a decode step can run at: rows a batch bucket, kv_len a kv bucket
        (64, 128, ..., cache_len), k a variant. 16 slots x 4,096 tokens, K = 3, adaptive: 5 x 8 x 2 x 2."""
        rows = sorted({self.batch_bucket(n) for n in range(1, self.slots + 1)})
        kv_lens = sorted({self.kv_len_for(p) for p in range(self.cache_len - self.reach - 1)})
        return [
            (r, kv, logits, k)
            for r in rows
            for kv in kv_lens
            for logits in (False, True)
            for k in self.variants
        ]
