"""Training-time test (EAGLE-3): the draft is unrolled for several steps, each fed its own previous
hidden state, exactly as it runs at inference, and every step is scored against the target.

Step i, row p (position p): the input is the draft's own step i-1 output at row p - 1 (step 0: the
fused target hidden state at p) with the embedding of the true token at p + 1; it predicts the token at
p + 2, scored by soft cross-entropy against the target's distribution there (over the draft
vocabulary), weighted 0.8^i. Rows p < i have no chain of i own steps behind them and are not scored.

At inference the chain's keys come from the step that wrote each position: the query at p in step i
sees step-0 keys at positions <= p - i and then one key from each later step: step j's key at
p - (i - j). ttt_mask builds that pattern over the step-major concatenation of all steps' keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from redline.layers.attention import AttentionBatch
from redline.models.eagle3 import Eagle3Draft

STEP_DECAY = 0.8


def ttt_mask(rows: int, step: int, device: torch.device) -> torch.Tensor:
    """[1, 1, rows, (step + 1) * rows] bool. rows 4, step 1: row 3 sees step-0 keys 0..2 and step-1 key 3;
    row 1 sees step-0 key 0 and step-1 key 1; row 0 only its own step-1 key (it is not scored)."""
    p = torch.arange(rows, device=device)[:, None]  # [rows, 1] query row
    r = torch.arange(rows, device=device)[None, :]  # [1, rows] key row within a step's block
    blocks = [r <= p - step] + [r == p - (step - j) for j in range(1, step + 1)]
    return torch.cat(blocks, dim=1)[None, None]


def ttt_unroll(
    draft: Eagle3Draft,
    tokens: torch.Tensor,  # [B, T] int64
    aux: torch.Tensor,  # [B, T, 3 * H_target] the target's aux hidden states
    steps: int,
) -> list[torch.Tensor]:
    """The draft's logits [B, T - 1, V_draft] at each step; row p of step i predicts the token at p + 2."""
    b, t = tokens.shape
    rows = t - 1  # row p reads the token at p + 1
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    positions = torch.arange(rows, device=tokens.device)[None].expand(b, rows)
    batch = AttentionBatch.build(draft.config.layer, draft.rotary, positions, positions, 0)
    embeds = draft.embed(tokens[:, 1:])  # [B, rows, H]
    hidden = draft.fuse(aux[:, :rows])  # [B, rows, H]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    logits = []
    for step in range(steps):
        x, residual = layer.attention_input(embeds, hidden)
        q, k, v = attn.project(x, batch)
        keys.append(k.transpose(1, 2))
        values.append(v.transpose(1, 2))
        mask = ttt_mask(rows, step, tokens.device)
        out = layer.finish(residual, attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask))
        logits.append(draft.logits(out))
        hidden = torch.cat(
            (torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1
        )  # step + 1 row p reads row p - 1
    return logits


def ttt_loss(
    draft: Eagle3Draft,
    tokens: torch.Tensor,  # [B, T] int64
    aux: torch.Tensor,  # [B, T, 3 * H_target]
    target_probs: torch.Tensor,  # [B, T, V_draft] the target's next-token distribution at each position
    steps: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted TTT loss and per-step top-1 agreement with the target ("acc0", "acc1", ...)."""
    target = target_probs[:, 1:]  # row p predicts the token at p + 2: the target's distribution at p + 1
    target_top = target.argmax(-1)
    total = torch.zeros((), device=tokens.device)
    metrics = {}
    for step, logits in enumerate(ttt_unroll(draft, tokens, aux, steps)):
        scored = slice(step, logits.shape[1])
        ce = -(target[:, scored] * F.log_softmax(logits[:, scored], dim=-1)).sum(-1)
        total = total + STEP_DECAY**step * ce.mean()
        agree = logits[:, scored].argmax(-1) == target_top[:, scored]
        metrics[f"acc{step}"] = agree.float().mean().item()
    return total, metrics
