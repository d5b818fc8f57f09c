"""Emitting tokens and proposing drafts: the one function behind a prefill's first tokens and every decode
step.

Given the target's hidden states at T positions of each row, with the T - 1 drafts that sit between them,
it picks the target's tokens (argmax, or sampling with penalties and filters), verifies the drafts (greedy
or by rejection), counts what it emitted for the penalties, and runs the draft's K proposals from the last
accepted position. A decode step calls it with T = K + 1 (pending = last token + K drafts); a prefill with
T = 1 at each chunk's last row (no drafts to verify). Under tensor parallelism every rank then takes
rank 0's decisions, so all ranks feed the same tokens to the next forward.

Proposals come from the EAGLE-3 draft, from n-gram lookup in each row's own tokens (speculative/ngram.py),
or from both: then each row takes the n-gram proposal where its tokens hold a match, the draft's elsewhere.
An n-gram proposal is deterministic: its stored distribution is all zeros, which verification reads as a
one-hot on the proposed token. Beside a draft tree, a row with a match verifies the n-gram chain and the
tree's first nodes that still fit.

Example, K = 2, a decode row with pending [a, d1, d2] at positions [p, p + 1, p + 2]: the target's choices
after a, d1, d2 are [d1, x, y] -> d1 accepted, d2 rejected (x != d2): tokens [d1, x, *], n_acc 1; the draft
continues from the row at p + 1 (whose next token is now x) and proposes [e1, e2]; pending becomes
[x, e1, e2] at position p + 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redline import logprobs
from redline.draft_tree import TreeShape
from redline.models.eagle3 import Eagle3Draft
from redline.models.llama import LlamaForCausalLM
from redline.parallel.vocab import BlockShaping
from redline.penalties import count_emitted, counts_after_drafts, penalize, with_bias
from redline.sampling import SamplingTensors, filtered_probs
from redline.speculative import ngram
from redline.speculative.ngram import NgramRange
from redline.speculative.propose import DraftInputs, propose, propose_tree
from redline.speculative.tree import chain_into_tree
from redline.speculative.verify import greedy_verify, rejection_verify
from redline.structured.bitmask import allowed_logits
from redline.structured.draft_masks import DraftVocabulary, ProposalRules
from redline.structured.token_controls import bias_block


def target_probs(
    logits: torch.Tensor,  # [B, T, V] fp32, the target's
    sampling: SamplingTensors,  # rows B
    counts: torch.Tensor,  # [B, T, V] the generated-token counts each row's position sees
    seen: torch.Tensor,  # [B, V] bool
) -> torch.Tensor:  # [B, T, V] fp32
    """What each row's token is drawn from (a greedy row: the one-hot on its argmax): its mask (a grammar,
    bad words), its slot's bias row (logit_bias, allowed_token_ids), the penalties, then temperature and
    the filters."""
    shaped = with_bias(allowed_logits(logits, sampling.allowed[:, : logits.shape[1]]), sampling.bias[:, None])
    return filtered_probs(penalize(shaped, sampling, counts, seen), sampling)


def argmax_shaping(sampling: SamplingTensors) -> BlockShaping:
    """The argmax path's target logits, each rank's block [B, T, N]: its rows' masks (a grammar,
    bad words) and its slots' bias rows (logit_bias, bad words of one token) applied; all-allowed masks and
    zero rows leave it as it was. Requests with allowed_token_ids take the logits path, where a row the
    bias leaves nothing keeps its mask (penalties.with_bias): here the bias is finite or the mask's."""

    def shape(local: torch.Tensor, first: int) -> torch.Tensor:
        bits = sampling.allowed[:, : local.shape[1]]
        return allowed_logits(local, bits, first) + bias_block(sampling.bias, first, local.shape[-1])[:, None]

    return shape


@dataclass
class Emitted:
    tokens: torch.Tensor  # [B, T]: the first n_acc + 1 are new
    accepted: torch.Tensor  # [B] n_acc
    pending: torch.Tensor  # [B, K + 1]: the next step's input, the bonus token then K drafts
    draft_probs: torch.Tensor | None  # [B, K, V_draft]: what the drafts were sampled from (logits path;
    # zeros for an n-gram proposal)
    packed: torch.Tensor | None  # [B, T * logprobs.width]: the tokens' log-probabilities (logits path)
    parents: torch.Tensor | None = None  # [B, N]: a draft tree's rows' parents (pending holds its tokens)


class Emitter:
    def __init__(
        self,
        target: LlamaForCausalLM,
        draft: Eagle3Draft | None,
        k: int,
        lookup: NgramRange | None = None,
        tree: TreeShape | None = None,
        masks_drafts: bool = False,  # the rows' rules on the draft's proposals (structured/draft_masks.py)
    ):
        """k > 0 needs a draft, n-gram lookup or both; a tree (k = its steps) needs a draft."""
        self.target, self.draft, self.k, self.lookup, self.tree = target, draft, k, lookup, tree
        self.draft_vocabulary = None
        if draft is not None:  # draft id -> target id for the whole draft vocabulary (q on the target's)
            ids = torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device)
            self.draft_to_target = draft.to_target(ids)
            if masks_drafts:
                self.draft_vocabulary = DraftVocabulary.of(self.draft_to_target, target.config.vocab_size)

    def __call__(
        self,
        hidden: torch.Tensor,  # [B, T, H] the target's final hidden states at the emitting positions
        drafts: torch.Tensor,  # [B, T - 1] the drafts between them (the token after position j is drafts[j])
        draft_probs: torch.Tensor | None,  # [B, T - 1, V_draft] what the drafts were sampled from
        positions: torch.Tensor,  # [B, T] the emitting positions
        sampling: SamplingTensors,  # rows B
        counts: torch.Tensor | None,  # [B, V] int32 generated-token counts (logits path), updated in place
        seen: torch.Tensor | None,  # [B, V] bool prompt tokens (logits path)
        emitting: torch.Tensor,  # [B] bool rows that really emit (active slots, final chunks)
        any_sampling: bool,  # the logits path (host-known): some row samples, is penalized or wants logprobs
        draft_inputs: DraftInputs | None,
        history: torch.Tensor | None = None,  # [B, L] n-gram lookup: the rows' tokens by position, written
    ) -> Emitted:
        logits = None
        if not any_sampling:  # argmax only: under tensor parallelism, no logits gathered
            choices = self.target.greedy_tokens(hidden, argmax_shaping(sampling))
            tokens, accepted = greedy_verify(choices, drafts)
        else:
            assert counts is not None and seen is not None
            logits = self.target.logits(hidden)  # [B, T, V]
            p = target_probs(logits, sampling, counts_after_drafts(counts, drafts), seen)
            q = self._draft_q(draft_probs, drafts, sampling)
            tokens, accepted = rejection_verify(p, q, drafts, sampling.seed, positions)
        return self.finish(tokens, accepted, logits, positions, sampling, counts, seen, emitting,
                           any_sampling, draft_inputs, history)  # fmt: skip

    def finish(
        self,
        tokens: torch.Tensor,  # [B, T] emitted: the first n_acc + 1 are new
        accepted: torch.Tensor,  # [B] n_acc
        logits: torch.Tensor | None,  # [B, T, V] the target's at the emitting positions (logits path)
        positions: torch.Tensor,  # [B, T] the emitting positions
        sampling: SamplingTensors,
        counts: torch.Tensor | None,  # [B, V] int32, updated in place (logits path)
        seen: torch.Tensor | None,  # [B, V] bool (logits path)
        emitting: torch.Tensor,  # [B] bool
        any_sampling: bool,
        draft_inputs: DraftInputs | None,
        history: torch.Tensor | None,  # [B, L]
    ) -> Emitted:
        """After verification: the emitted tokens counted and their log-probabilities packed, then the next
        step's drafts proposed."""
        t, packed = tokens.shape[1], None
        if logits is not None:
            assert counts is not None
            new = (torch.arange(t, device=tokens.device) <= accepted[:, None]) & emitting[:, None]  # [B, T]
            count_emitted(counts, tokens, new)  # for the proposals below and the next step's penalties
            packed = logprobs.pack(logits, tokens)
        bonus = tokens.gather(1, accepted[:, None])  # [B, 1] the next pending[:, 0]
        pending, probs, parents = bonus, None, None
        if self.draft is not None:
            assert draft_inputs is not None
            drafted, probs, parents = self._propose(tokens, accepted, emitting, sampling, counts, seen,
                                                    any_sampling, draft_inputs)  # fmt: skip
            pending = torch.cat((bonus, drafted), dim=1)
            if self.target.tp.size > 1:  # rank 0's decisions (parallel/group.py)
                shared = [tokens, accepted[:, None], pending] + ([] if parents is None else [parents])
                decided = self.target.tp.from_first_rank(torch.cat(shared, 1))
                widths = [part.shape[1] for part in shared]
                tokens, accepted, pending, *rest = decided.split(widths, dim=1)
                accepted, parents = accepted[:, 0], rest[0] if rest else None  # [B, T | 1 | K + 1 (| N)]
        if self.lookup is not None:
            assert history is not None
            pending, probs, parents = self._lookup(history, tokens, accepted, positions, emitting, pending,
                                                   probs, parents)  # fmt: skip
        return Emitted(tokens, accepted, pending, probs, packed, parents)

    def _lookup(
        self,
        history: torch.Tensor,  # [B, L]
        tokens: torch.Tensor,  # [B, T]
        accepted: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B, T]
        emitting: torch.Tensor,  # [B]
        pending: torch.Tensor,  # [B, 1] the bonus token, or [B, K + 1] with the draft's proposals ([B, N]
        # with a tree)
        probs: torch.Tensor | None,  # [B, K, V_draft] the draft's proposals' distributions
        parents: torch.Tensor | None,  # [B, N] a draft tree's
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Records the emitted tokens in the rows' history, then proposes from it: the n-gram drafts
        alone, or in place of the draft's where a row has a match; beside a tree, in front of its first
        nodes (tree.chain_into_tree)."""
        new = (torch.arange(tokens.shape[1], device=tokens.device) <= accepted[:, None]) & emitting[:, None]
        ngram.record(history, tokens, positions, new)
        last = positions.gather(1, accepted[:, None])[:, 0] + 1  # [B] where the bonus token sits
        assert self.lookup is not None
        drafts, found = ngram.propose(history, last, self.k, self.lookup)
        if self.draft is None:
            return torch.cat((pending, drafts), dim=1), None, None
        if parents is not None:
            chained, chained_parents = chain_into_tree(pending, parents, drafts)
            pending = torch.where(found[:, None], chained, pending)
            return pending, None, torch.where(found[:, None], chained_parents, parents)
        pending = torch.cat((pending[:, :1], torch.where(found[:, None], drafts, pending[:, 1:])), dim=1)
        if probs is not None:  # an n-gram proposal's q is a one-hot (_draft_q): marked by zeros
            probs = torch.where(found[:, None, None], 0.0, probs)
        return pending, probs, None

    def _propose(
        self,
        tokens: torch.Tensor,  # [B, T]
        accepted: torch.Tensor,  # [B]
        emitting: torch.Tensor,  # [B]
        sampling: SamplingTensors,
        counts: torch.Tensor | None,  # [B, V]
        seen: torch.Tensor | None,  # [B, V]
        any_sampling: bool,
        inputs: DraftInputs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """drafts [B, K] (target ids), probs [B, K, V_draft] when sampling; with a tree, drafts [B, N - 1]
        and parents [B, N] (no probs: a tree's nodes are the draft's top tokens, deterministic).

        The draft over the forward's rows, each emitting row reading the token emitted after it, then
        the chain (or the tree) from row first_row + n_acc. Rows [3, 4] of L = 6 emit [x, y] ->
        next_tokens[:, 3:5] = [x, y] (rows that do not emit keep the tokens they were given)."""
        t = tokens.shape[1]
        rows = inputs.first_row[:, None] + torch.arange(t, device=tokens.device)  # [B, T]
        known = inputs.next_tokens.gather(1, rows)
        next_tokens = inputs.next_tokens.scatter(1, rows, torch.where(emitting[:, None], tokens, known))
        if not inputs.proposes:  # the draft's keys at the verified rows kept for later, then copies of the
            # bonus token; the keys are written DEFERRED steps at a time (speculative/deferred_keys.py)
            assert inputs.deferred is not None
            inputs.deferred.record(inputs.aux, next_tokens, inputs.positions, emitting)
            return self._no_proposals(tokens.gather(1, accepted[:, None]), any_sampling)
        penalties = None
        if any_sampling:  # the proposals are penalized as verification will be
            assert counts is not None and seen is not None
            penalties = (counts, seen)
        assert self.draft is not None
        row = inputs.first_row + accepted
        rules = None
        if self.draft_vocabulary is not None:
            slots = torch.arange(len(row), device=row.device) if inputs.slots is None else inputs.slots
            rules = ProposalRules(self.draft_vocabulary, torch.where(emitting, slots, -1), tokens, accepted)
        if self.tree is not None:
            drafts, parents = propose_tree(
                self.draft, inputs, next_tokens, row, self.tree, sampling, penalties, rules
            )
            return drafts, None, parents
        proposed = propose(
            self.draft, inputs, next_tokens, row, self.k, sampling, any_sampling, penalties, rules
        )
        return *proposed, None

    def _no_proposals(
        self,
        bonus: torch.Tensor,  # [B, 1]
        any_sampling: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What a step that drafts nothing leaves pending: drafts [B, K], the bonus token K times, proposed
        deterministically (probs [B, K, V_draft] zeros: a one-hot q), so a step that verifies them stays
        exact. With a tree: drafts [B, N - 1], N - 1 copies of it, each a child of the root (parents [B, N]
        zeros; a tree's nodes are deterministic)."""
        assert self.draft is not None
        if self.tree is not None:
            parents = torch.zeros(bonus.shape[0], self.tree.nodes, dtype=torch.int64, device=bonus.device)
            return bonus.expand(-1, self.tree.nodes - 1), None, parents
        probs = None
        if any_sampling:
            probs = torch.zeros(
                bonus.shape[0], self.k, self.draft.config.draft_vocab_size, device=bonus.device
            )
        return bonus.expand(-1, self.k), probs, None

    def _draft_q(
        self,
        draft_probs: torch.Tensor | None,  # [B, T - 1, V_draft]
        drafts: torch.Tensor,  # [B, T - 1] target ids
        sampling: SamplingTensors,
    ) -> torch.Tensor:  # [B, T - 1, V]
        """The drafts' distributions on the target vocabulary; greedy rows get a one-hot on their draft
        (their stored distributions may be stale, and greedy verification needs exactly that), and so do
        n-gram proposals (stored as zeros: a sampled distribution sums to 1)."""
        vocab = self.target.config.vocab_size
        one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
        if draft_probs is None or drafts.shape[1] == 0:
            return one_hot
        index = self.draft_to_target.expand(*draft_probs.shape[:2], -1)
        q = torch.zeros(*draft_probs.shape[:2], vocab, device=drafts.device).scatter_(-1, index, draft_probs)
        sampled = (sampling.temperature[:, None] > 0) & (draft_probs.sum(dim=-1) > 0)  # [B, T - 1]
        return torch.where(sampled[..., None], q, one_hot)
