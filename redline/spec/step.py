"""The decode step: target forward over pending tokens, verification, draft proposals, state update.

A pure function of device tensors with static shapes (no host sync, no data-dependent branch), so it
compiles with fullgraph=True and captures as one CUDA graph. Without a draft it is plain decoding
(K = 0: pending holds just the last token).

state, one row per slot:
  pending [S, K + 1]  the last emitted token, then K draft tokens
  pos [S]             absolute position of pending[:, 0]
  active [S]          rows of free slots compute (at position 0, in the scratch block) but never advance
  draft_probs [S, K, V_draft]  the distributions the drafts were sampled from (sampling requests only)
  counts [S, V], seen [S, V]   penalized requests' generated-token counts, prompt-token mask (penalties.py)

Two variants, chosen on the host: the argmax path when every row is greedy without penalties or logprobs,
else the logits path (any_sampling): the target's logits, penalized, filtered, sampled or verified by
rejection, and the emitted tokens' log-probabilities packed after the tokens (logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redline import logprobs
from redline.engine.kv_cache import KVCache
from redline.models.eagle3 import Eagle3Draft
from redline.models.llama import LlamaForCausalLM
from redline.penalties import count_emitted, counts_after_drafts, penalize
from redline.sampling import SamplingTensors, filtered_probs, select_tokens
from redline.spec.draft_loop import propose
from redline.spec.verify import greedy_verify, rejection_verify


@dataclass
class DecodeState:
    pending: torch.Tensor  # [S, K + 1] int64
    pos: torch.Tensor  # [S] int64
    active: torch.Tensor  # [S] bool
    draft_probs: torch.Tensor | None  # [S, K, V_draft] fp32
    counts: torch.Tensor  # [S, V] int32
    seen: torch.Tensor  # [S, V] bool

    @classmethod
    def empty(
        cls, slots: int, k: int, vocab: int, draft_vocab: int | None, device: torch.device
    ) -> DecodeState:
        probs = None if draft_vocab is None else torch.zeros(slots, k, draft_vocab, device=device)
        return cls(
            pending=torch.zeros(slots, k + 1, dtype=torch.int64, device=device),
            pos=torch.zeros(slots, dtype=torch.int64, device=device),
            active=torch.zeros(slots, dtype=torch.bool, device=device),
            draft_probs=probs,
            counts=torch.zeros(slots, vocab, dtype=torch.int32, device=device),
            seen=torch.zeros(slots, vocab, dtype=torch.bool, device=device),
        )


class DecodeStep:
    """Callable step over slots [0, rows). Returns out [rows, K + 2 (+ (K + 1) x logprobs.width)]: emitted
    tokens [:, :K + 1] (the first n_acc + 1 are new), n_acc, and on the logits path the emitted tokens'
    packed log-probabilities, so the host reads one tensor per step."""

    def __init__(
        self,
        target: LlamaForCausalLM,
        draft: Eagle3Draft | None,
        k: int,
        cache: KVCache,
        draft_cache: KVCache | None,
        state: DecodeState,
        sampling: SamplingTensors,
    ):
        self.target, self.draft, self.k = target, draft, k
        self.cache, self.draft_cache = cache, draft_cache
        self.state, self.sampling = state, sampling
        if draft is not None:
            # draft id -> target id for the whole draft vocabulary, to lift q onto the target vocabulary
            self.draft_to_target = draft.to_target(
                torch.arange(draft.config.draft_vocab_size, device=state.pos.device)
            )

    def __call__(self, rows: int, kv_len: int, any_sampling: bool) -> torch.Tensor:
        st, k = self.state, self.k
        pending, active = st.pending[:rows], st.active[:rows]
        # A free slot still computes when it lies inside the batch bucket, from whatever state its last
        # request left: a request that ended at the context limit leaves pos up to max_len + K, and the
        # draft chain writes pos + 2K - 1, past the cache. Free rows compute at position 0 instead.
        pos = torch.where(active, st.pos[:rows], 0)
        sampling = self.sampling.rows(0, rows)
        positions = pos[:, None] + torch.arange(k + 1, device=pos.device)  # [B, K + 1]
        # free rows, and slots still prefilling chunk by chunk, read and write the scratch block only
        tables = torch.where(active[:, None], self.cache.tables(0, rows), self.cache.scratch_block)
        hidden, aux = self.target(pending, positions, self.cache.layers, tables, kv_len)
        if not any_sampling:  # argmax only: under tensor parallelism, no logits gathered
            emitted = self.target.greedy_tokens(hidden)  # [B, K + 1]
            emitted, n_acc = greedy_verify(emitted, pending[:, 1:]) if self.draft else (emitted, None)
        elif self.draft is None:
            logits = self.target.logits(hidden)  # [B, 1, V]
            penalized = penalize(logits, sampling, st.counts[:rows, None], st.seen[:rows])
            emitted = select_tokens(penalized, sampling, positions + 1, any_sampling)  # [B, 1]
        else:
            logits = self.target.logits(hidden)  # [B, K + 1, V]
            counts = counts_after_drafts(st.counts[:rows], pending[:, 1:])  # [B, K + 1, V]
            p = filtered_probs(penalize(logits, sampling, counts, st.seen[:rows]), sampling)
            emitted, n_acc = rejection_verify(
                p, self._draft_q(rows, pending, sampling), pending[:, 1:], sampling.seed, positions
            )
        if self.draft is None:
            n_acc = torch.zeros_like(pos)
        if any_sampling:  # the new tokens count for the draft's proposals and the next step's penalties
            new = (torch.arange(k + 1, device=pos.device) <= n_acc[:, None]) & active[:, None]  # [B, K + 1]
            count_emitted(st.counts[:rows], emitted, new)
        bonus = emitted.gather(1, n_acc[:, None])  # [B, 1] the new pending[:, 0]
        new_pending = bonus
        if self.draft is not None:
            assert self.draft_cache is not None
            drafts, probs = propose(
                self.draft,
                aux,
                emitted,
                positions,
                n_acc,
                k,
                self.draft_cache.layers[0],
                tables,
                kv_len,
                sampling,
                any_sampling,
                (st.counts[:rows], st.seen[:rows]) if any_sampling else None,
            )
            new_pending = torch.cat((bonus, drafts), dim=1)
            if probs is not None and st.draft_probs is not None:
                st.draft_probs[:rows] = probs
        if self.draft is not None and self.target.tp.size > 1:  # rank 0's decisions (parallel/group.py)
            decided = self.target.tp.from_first_rank(torch.cat((emitted, n_acc[:, None], new_pending), dim=1))
            emitted, n_acc, new_pending = decided.split([emitted.shape[1], 1, new_pending.shape[1]], dim=1)
            n_acc = n_acc[:, 0]  # [B, K + 1 | 1 | K + 1] -> [B]
        st.pending[:rows] = torch.where(active[:, None], new_pending, pending)
        st.pos[:rows] = pos + (n_acc + 1) * active
        out = torch.cat((emitted, n_acc[:, None]), dim=1)
        return torch.cat((out, logprobs.pack(logits, emitted)), dim=1) if any_sampling else out

    def _draft_q(self, rows: int, pending: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        """Draft distributions on the target vocabulary [B, K, V]; greedy rows get a one-hot on their draft
        (their stored distributions may be stale, and greedy verification needs exactly that)."""
        assert self.state.draft_probs is not None
        vocab = self.target.config.vocab_size
        q_draft = self.state.draft_probs[:rows]  # [B, K, V_draft]
        index = self.draft_to_target.expand(*q_draft.shape[:2], -1)
        q = torch.zeros(*q_draft.shape[:2], vocab, device=q_draft.device).scatter_(-1, index, q_draft)
        one_hot = torch.nn.functional.one_hot(pending[:, 1:], vocab).float()
        return torch.where(sampling.temperature[:, None, None] > 0, q, one_hot)
