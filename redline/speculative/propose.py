"""The draft's K proposals: one draft pass over the verified rows (static shape), a gather of the row
each slot continues from, then K - 1 single-token steps on the draft's own hidden state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redline.draft_tree import TreeShape
from redline.models.eagle3 import Eagle3Draft
from redline.models.llama import KVLayer
from redline.penalties import penalize, with_bias
from redline.sampling import SamplingTensors, filtered_probs, sample_from
from redline.speculative.deferred_keys import DeferredKeys
from redline.speculative.tree import expand
from redline.structured.draft_masks import ProposalRules
from redline.structured.token_controls import bias_block

DRAFT_STREAM = 2  # random stream of draft sampling


@dataclass
class DraftInputs:
    """What the draft's pass over a forward's L rows reads: the target's aux hidden states there, the token
    after each row where known (the emitted ones are filled in), and where the verified rows begin."""

    aux: torch.Tensor  # [B, L, 3 * H_target]
    next_tokens: torch.Tensor  # [B, L]: the token at p + 1 for the row at p
    positions: torch.Tensor  # [B, L]
    first_row: torch.Tensor  # [B]: the row of the first emitting position
    cache: KVLayer  # the draft's KV layer
    tables: torch.Tensor  # [B, blocks per sequence] int32
    kv_len: int  # keys the draft attends: past its chain's last write
    proposes: bool = True  # False: a step that drafts nothing keeps what the draft's keys need (deferred)
    one_row: bool = False  # the draft's layer over the row the proposals continue from only, the other
    # rows' keys written alone (a prefill's hundreds of rows: see draft_root)
    deferred: DeferredKeys | None = None  # where such a step leaves it
    slots: torch.Tensor | None = None  # [B] each row's slot (None: row b is slot b, as in a decode step)


def propose(
    draft: Eagle3Draft,
    inputs: DraftInputs,
    next_tokens: torch.Tensor,  # [B, L] the token at position p + 1 for the row at p, emitted ones included
    row: torch.Tensor,  # [B] the last row whose next token is known (the chain continues from it)
    k: int,
    sampling: SamplingTensors,
    any_sampling: bool,
    penalties: tuple[torch.Tensor, torch.Tensor] | None = None,  # target counts [B, V], seen [B, V]
    rules: ProposalRules | None = None,  # the rows' rules (one process, no CUDA graph)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns draft tokens [B, K] (target ids) and, when sampling, their distributions [B, K, V_draft].
    The draft's logits take the slots' bias rows and, with `rules`, their masks after the emitted tokens
    and the proposals before (structured/draft_masks.py); with penalties (penalties.py) they are penalized
    as the target's are, each proposal counting the ones before it, so its proposals follow the
    distribution verification will use."""
    cache, tables, kv_len = inputs.cache, inputs.tables, inputs.kv_len
    bias, *counts_seen = on_draft_vocabulary(draft, sampling.bias, *(penalties or ()))
    counts, seen = counts_seen or (None, None)
    h, position = draft_root(draft, inputs, next_tokens, row)
    tokens: list[torch.Tensor] = []
    probs = []

    def masked(logits: torch.Tensor) -> torch.Tensor:  # [B, 1, V_draft] (one process: the whole vocabulary)
        """The rows' rules after the proposals so far (before the bias, as the target's masks are)."""
        if rules is None:
            return logits
        return rules.mask(logits, torch.cat(tokens, dim=1)[:, None] if tokens else next_tokens[:, None, :0])

    for step in range(k):
        if any_sampling:
            logits = with_bias(masked(draft.logits(h)), bias[:, None])  # [B, 1, V_draft]
            if counts is not None and seen is not None:
                logits = penalize(logits, sampling, counts[:, None], seen)
            q = filtered_probs(logits, sampling)
            choice = sample_from(q, sampling.seed, position + 2, DRAFT_STREAM)
            probs.append(q)
            if counts is not None:
                counts = counts.scatter_add(1, choice, torch.ones_like(choice, dtype=counts.dtype))
        else:  # argmax only: under tensor parallelism, no logits gathered
            biased = lambda local, first: masked(local) + bias_block(bias, first, local.shape[-1])[:, None]
            choice = draft.greedy_tokens(h, biased)  # [B, 1]
        token = draft.to_target(choice)  # [B, 1]
        tokens.append(token)
        if step < k - 1:
            position = position + 1
            h = draft(token, h, position, cache, tables, kv_len)
    return torch.cat(tokens, dim=1), torch.cat(probs, dim=1) if any_sampling else None


def draft_root(
    draft: Eagle3Draft,
    inputs: DraftInputs,
    next_tokens: torch.Tensor,  # [B, L]
    row: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:  # h [B, 1, H], position [B, 1]
    """The draft's pass over the forward's rows (writing its cache there), and its hidden state and position
    at the row the proposals continue from: the row at p predicts the token at p + 2.

    With inputs.one_row, every row's keys are written first (fc and the k/v products only) and the layer
    runs over that one row, which attends to them: the same hidden state, without the attention and the
    MLP of rows whose outputs nobody reads (a prefill of 300 rows: 299 of them)."""
    positions, fused = inputs.positions, draft.fuse(inputs.aux)  # [B, L], [B, L, H]
    at_row = row[:, None]  # [B, 1]
    if inputs.one_row:
        draft.write_keys(next_tokens, fused, positions, inputs.cache, inputs.tables)
        fused = fused.gather(1, at_row[..., None].expand(-1, 1, fused.shape[-1]))  # [B, 1, H]
        next_tokens, positions = next_tokens.gather(1, at_row), positions.gather(1, at_row)
        return draft(next_tokens, fused, positions, inputs.cache, inputs.tables, inputs.kv_len), positions
    hidden = draft(next_tokens, fused, positions, inputs.cache, inputs.tables, inputs.kv_len)
    h = hidden.gather(1, at_row[..., None].expand(-1, 1, hidden.shape[-1]))  # [B, 1, H]
    return h, positions.gather(1, at_row)


def on_draft_vocabulary(draft: Eagle3Draft, *rows: torch.Tensor) -> list[torch.Tensor]:
    """Per-slot rows over the target's vocabulary (bias rows, counts, seen: [B, V]) -> [B, V_draft] each:
    draft id d is target id to_target(d)."""
    ids = draft.to_target(torch.arange(draft.config.draft_vocab_size, device=rows[0].device))
    return [row[:, ids] for row in rows]


def propose_tree(
    draft: Eagle3Draft,
    inputs: DraftInputs,
    next_tokens: torch.Tensor,  # [B, L]
    row: torch.Tensor,  # [B] the last row whose next token is known
    shape: TreeShape,
    sampling: SamplingTensors,
    penalties: tuple[torch.Tensor, torch.Tensor] | None = None,  # target counts [B, V], seen [B, V]
    rules: ProposalRules | None = None,  # the rows' rules (one process, no CUDA graph)
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [B, N - 1] (target ids), parents [B, N]
    """A draft tree (speculative/tree.py) from the row: its nodes are the draft's top tokens, masked by
    the rows' rules along each branch, penalized by the counts so far (not along each branch: proposals
    only steer acceptance, never the output)."""
    h, position = draft_root(draft, inputs, next_tokens, row)
    bias, *counts_seen = on_draft_vocabulary(draft, sampling.bias, *(penalties or ()))

    def logits_of(x: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:  # [B, T, V_draft]
        """x [B, T, H] the draft's hidden states at T frontier entries, paths [B, T, D] theirs."""
        logits = draft.logits(x)
        logits = with_bias(logits if rules is None else rules.mask(logits, paths), bias[:, None])
        if not counts_seen:
            return logits
        counts, seen = counts_seen
        return penalize(logits, sampling, counts[:, None], seen)

    tokens, parents, _ = expand(
        draft, h, position, inputs.cache, inputs.tables, inputs.kv_len, shape, logits_of
    )
    return tokens, parents
