"""The decode step: target forward over pending tokens, verification, draft proposals, state update.

A pure function of device tensors with static shapes (no host sync, no data-dependent branch), so it
compiles with fullgraph=True and captures as one CUDA graph. Without a drafter (an EAGLE-3 draft, n-gram
lookup or both) it is plain decoding (K = 0: pending holds just the last token). With one, a step verifies
k drafts: K, or 0 (adaptive draft length, engine/draft_length.py: the target over each slot's last token,
the draft's keys written at it or, with `deferred`, what they need kept for a later pass
(speculative/deferred_keys.py), n-gram proposals still made), each k its own graph.

state, one row per slot:
  pending [S, K + 1]  the last emitted token, then K draft tokens
  pos [S]             absolute position of pending[:, 0]
  active [S]          rows of free slots compute (at position 0, in the scratch block) but never advance
  draft_probs [S, K, V_draft]  the distributions the drafts were sampled from (sampling requests only)
  counts [S, V], seen [S, V]   penalized requests' generated-token counts, prompt-token mask (penalties.py)
  history [S, L]      n-gram lookup: each slot's tokens by position, prompt and output (speculative/ngram.py)
  parents [S, N]      a draft tree (speculative/tree.py): pending holds its N rows' tokens, this their parents

Two variants, chosen on the host: the argmax path when every row is greedy without penalties or logprobs,
else the logits path (any_sampling): the target's logits, penalized, filtered, sampled or verified by
rejection, and the emitted tokens' log-probabilities packed after the tokens (logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redline.models.kv_cache import KVCache
from redline.sampling import SamplingTensors
from redline.speculative.deferred_keys import DeferredKeys
from redline.speculative.emit import Emitter
from redline.speculative.propose import DraftInputs


@dataclass
class DecodeState:
    pending: torch.Tensor  # [S, K + 1] int64
    pos: torch.Tensor  # [S] int64
    active: torch.Tensor  # [S] bool
    draft_probs: torch.Tensor | None  # [S, K, V_draft] fp32
    counts: torch.Tensor  # [S, V] int32
    seen: torch.Tensor  # [S, V] bool
    history: torch.Tensor | None = None  # [S, L] int64
    parents: torch.Tensor | None = None  # [S, N] int64

    @classmethod
    def empty(
        cls,
        slots: int,
        k: int,
        vocab: int,
        draft_vocab: int | None,
        device: torch.device,
        history_len: int | None = None,  # n-gram lookup: positions each slot's history holds
        tree_nodes: int | None = None,  # a draft tree's rows (pending's width)
    ) -> DecodeState:
        probs = None if draft_vocab is None else torch.zeros(slots, k, draft_vocab, device=device)
        history = None
        if history_len is not None:
            history = torch.zeros(slots, history_len, dtype=torch.int64, device=device)
        parents = None
        if tree_nodes is not None:  # every row a child of the root until the first tree is drafted
            parents = torch.zeros(slots, tree_nodes, dtype=torch.int64, device=device)
            probs = None  # a tree's nodes are deterministic
        return cls(
            pending=torch.zeros(slots, tree_nodes or k + 1, dtype=torch.int64, device=device),
            pos=torch.zeros(slots, dtype=torch.int64, device=device),
            active=torch.zeros(slots, dtype=torch.bool, device=device),
            draft_probs=probs,
            counts=torch.zeros(slots, vocab, dtype=torch.int32, device=device),
            seen=torch.zeros(slots, vocab, dtype=torch.bool, device=device),
            history=history,
            parents=parents,
        )


class DecodeStep:
    """Callable step over slots [0, rows). Returns out [rows, K + 2 (+ (K + 1) x logprobs.width)]: emitted
    tokens [:, :K + 1] (the first n_acc + 1 are new), n_acc, and on the logits path the emitted tokens'
    packed log-probabilities, so the host reads one tensor per step."""

    def __init__(
        self,
        emitter: Emitter,
        cache: KVCache,
        draft_cache: KVCache | None,
        state: DecodeState,
        sampling: SamplingTensors,
        deferred: DeferredKeys | None = None,  # steps without drafts defer the draft's keys to it
    ):
        self.emit, self.target, self.k = emitter, emitter.target, emitter.k
        self.cache, self.draft_cache = cache, draft_cache
        self.state, self.sampling, self.deferred = state, sampling, deferred

    def __call__(self, rows: int, kv_len: int, any_sampling: bool, k: int | None = None) -> torch.Tensor:
        """k: the drafts this step verifies, K or 0 (a step that drafts nothing: the target over each
        slot's last token, the draft's keys kept, n-gram proposals still made; engine/draft_length.py)."""
        st, full = self.state, self.k
        k = full if k is None else k
        pending, active = st.pending[:rows, : k + 1], st.active[:rows]
        # A free slot still computes when it lies inside the batch bucket, from whatever state its last
        # request left: a request that ended at the context limit leaves pos up to max_len + K, and the
        # draft chain writes pos + 2K - 1, past the cache. Free rows compute at position 0 instead.
        pos = torch.where(active, st.pos[:rows], 0)
        sampling = self.sampling.rows(0, rows)
        positions = pos[:, None] + torch.arange(k + 1, device=pos.device)  # [B, k + 1]
        # free rows, and slots still prefilling chunk by chunk, read and write the scratch block only
        tables = torch.where(active[:, None], self.cache.tables(0, rows), self.cache.scratch_block)
        hidden, aux = self.target(pending, positions, self.cache.layers, tables, kv_len)
        draft_inputs = None
        if self.draft_cache is not None:
            assert aux is not None
            first_row = torch.zeros_like(pos)  # every row of the forward emits: k + 1 verified positions
            draft_inputs = DraftInputs(aux, pending, positions, first_row, self.draft_cache.layers[0], tables,
                                       kv_len, proposes=k > 0, deferred=self.deferred)  # fmt: skip
        draft_probs = None if st.draft_probs is None else st.draft_probs[:rows, :k]
        counts, seen = st.counts[:rows], st.seen[:rows]
        history = None if st.history is None else st.history[:rows, :kv_len]  # every position it writes
        e = self.emit(hidden, pending[:, 1:], draft_probs, positions, sampling, counts, seen, active,
                      any_sampling, draft_inputs, history)  # fmt: skip
        st.pending[:rows] = torch.where(active[:, None], e.pending, st.pending[:rows])
        # inactive rows keep their state: a constrained slot prefilled in the last plan waits for its masks
        st.pos[:rows] = torch.where(active, pos + e.accepted + 1, st.pos[:rows])
        if e.draft_probs is not None and st.draft_probs is not None:
            st.draft_probs[:rows] = torch.where(active[:, None, None], e.draft_probs, st.draft_probs[:rows])
        if e.parents is not None and st.parents is not None:  # a tree's step that drafted nothing
            st.parents[:rows] = torch.where(active[:, None], e.parents, st.parents[:rows])
        # k < K: the output as wide as K's, so the host reads one layout ([x, 0, 0, 0, n_acc] for k 0, K 3)
        tokens = torch.nn.functional.pad(e.tokens, (0, full - k))
        out = torch.cat((tokens, e.accepted[:, None]), dim=1)
        if e.packed is None:
            return out
        return torch.cat(
            (out, torch.nn.functional.pad(e.packed, (0, (full - k) * e.packed.shape[1] // (k + 1)))), 1
        )
