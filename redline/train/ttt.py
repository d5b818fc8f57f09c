"""Training-time test (EAGLE-3): the draft is unrolled for several steps, each fed its own previous
hidden state, exactly as it runs at inference, and every step is scored against the target.

Step i, row p (position p): the input is the draft's own step i-1 output at row p - 1 (step 0: the
fused target hidden state at p) with the embedding of the true token at p + 1; it predicts the token at
p + 2, scored by soft cross-entropy against the target's distribution there (over the draft
vocabulary), weighted 0.8^i. Rows p < i have no chain of i own steps behind them and are not scored.

At inference the chain's keys come from the step that wrote each position: the query at p in step i
sees step-0 keys at positions <= p - i and then one key from each later step: step j's key at
p - (i - j). So step i attends over one causal block (step 0's keys, shifted by i) plus i single
"diagonal" keys, one per later step: O(T^2 + i T) work, not O(i T^2). Rows 4, step 1 (query row x
key row, step-0 block | step-1 block; tests/test_training.py checks it against this dense mask):

    row 0:  . . . .  | 1 . . .
    row 1:  1 . . .  | . 1 . .
    row 2:  1 1 . .  | . . 1 .
    row 3:  1 1 1 .  | . . . 1

Rows are windows of a packed stream of sequences: `segments` names each position's sequence, and no
query sees a key, and no chain reaches a row, of another sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from redline.layers.attention import AttentionBatch
from redline.models.eagle3 import Eagle3Draft

STEP_DECAY = 0.8


def shift_rows(x: torch.Tensor, n: int, fill: float = 0) -> torch.Tensor:
    """Row p of the result is row p - n of x (dim 1), `fill` for p < n: [a, b, c], 1 -> [fill, a, b]."""
    if n == 0:
        return x
    return torch.cat((torch.full_like(x[:, :n], fill), x[:, :-n]), dim=1)


def chain_attention(
    q: torch.Tensor,  # [B, rows, heads, D] step i's queries (RoPE applied)
    keys: list[torch.Tensor],  # i + 1 tensors [B, rows, kv_heads, D]: the keys of steps 0..i
    values: list[torch.Tensor],  # same shapes
    segments: torch.Tensor,  # [B, rows] sequence id per row
) -> torch.Tensor:  # [B, rows, heads * D]
    """Attention of step i = len(keys) - 1 over the chain's keys (see the module docstring)."""
    step, (b, rows, heads, d) = len(keys) - 1, q.shape
    groups = heads // keys[0].shape[2]
    qh = q.transpose(1, 2)  # [B, heads, rows, D]

    def per_head(x: torch.Tensor) -> torch.Tensor:  # [B, rows, kv_heads, D] -> [B, heads, rows, D]
        return x.transpose(1, 2).repeat_interleave(groups, dim=1)

    p = torch.arange(rows, device=q.device)
    same = segments[:, :, None] == segments[:, None, :]  # [B, rows, rows]
    causal = (p[None, :] <= p[:, None] - step) & same  # row p sees step-0 keys r <= p - i
    scores = [(qh @ per_head(keys[0]).transpose(2, 3)).masked_fill(~causal[:, None], -torch.inf)]
    diagonal_values = []
    for j in range(1, step + 1):  # step j's key at p - (i - j)
        k, v = (per_head(shift_rows(x, step - j)) for x in (keys[j], values[j]))
        seen = shift_rows(segments, step - j, fill=-1) == segments  # [B, rows]
        scores.append((qh * k).sum(-1, keepdim=True).masked_fill(~seen[:, None, :, None], -torch.inf))
        diagonal_values.append(v)
    probs = torch.softmax(torch.cat(scores, dim=-1).float() * d**-0.5, dim=-1)  # [B, heads, rows, rows + i]
    out = probs[..., :rows].to(qh.dtype) @ per_head(values[0])
    for j, v in enumerate(diagonal_values):
        out = out + probs[..., rows + j, None].to(v.dtype) * v
    return out.transpose(1, 2).reshape(b, rows, heads * d)


def ttt_unroll(
    draft: Eagle3Draft,
    tokens: torch.Tensor,  # [B, T] int64
    aux: torch.Tensor,  # [B, T, 3 * H_target] the target's aux hidden states
    segments: torch.Tensor,  # [B, T] sequence id per position
    steps: int,
) -> list[torch.Tensor]:
    """The draft's hidden states [B, T - 1, H] (before its final norm) at each step; row p of step i
    predicts the token at p + 2 (draft.logits turns them into logits)."""
    b, t = tokens.shape
    rows = t - 1  # row p reads the token at p + 1
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    positions = torch.arange(rows, device=tokens.device)[None].expand(b, rows)
    batch = AttentionBatch.build(draft.config.layer, draft.rotary, positions, positions[:1, :1], None)
    embeds = draft.embed(tokens[:, 1:])  # [B, rows, H]
    hidden = draft.fuse(aux[:, :rows])  # [B, rows, H]
    keys, values, outputs = [], [], []  # per step: [B, rows, kv_heads, D] twice, [B, rows, H]
    for _ in range(steps):
        x, residual = layer.attention_input(embeds, hidden)
        q, k, v = attn.project(x, batch)
        keys.append(k)
        values.append(v)
        attended = attn.o_proj(chain_attention(q, keys, values, segments[:, :rows]))
        outputs.append(layer.finish(residual, attended))
        hidden = shift_rows(outputs[-1], 1)  # step + 1 row p reads row p - 1
    return outputs


def ttt_loss(
    draft: Eagle3Draft,
    tokens: torch.Tensor,  # [B, T] int64
    aux: torch.Tensor,  # [B, T, 3 * H_target]
    segments: torch.Tensor,  # [B, T]
    target_final: torch.Tensor,  # [B, T, H_target] the target's final normed hidden states
    target_head: torch.Tensor,  # [V_draft, H_target] the target's lm_head rows of the draft vocabulary
    scored: torch.Tensor,  # [B, T] bool: the target's distribution at this position is trained on
    steps: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted TTT loss and per-step top-1 agreement with the target ("acc0", "acc1", ...). Each step's
    soft cross-entropy against the target's softmax over the draft vocabulary is averaged over its
    scored rows. Logits are computed for the rows any step scores (a step's few unscored ones, at the
    start of a sequence, weigh 0); F.cross_entropy with probability targets fuses softmax, product and sum."""
    rows = segments[:, :-1]
    # row p predicts the token at p + 2: the target's distribution at p + 1, in the same sequence
    any_step = scored[:, 1:] & (segments[:, 1:] == rows)  # [B, rows]
    target = torch.softmax((target_final[:, 1:][any_step] @ target_head.T).float(), dim=-1)  # [n, V]
    target_top = target.argmax(-1)
    total = torch.zeros((), device=tokens.device)
    metrics = {}
    for step, hidden in enumerate(ttt_unroll(draft, tokens, aux, segments, steps)):
        chained = (shift_rows(rows, step, fill=-1) == rows)[any_step]  # [n] `step` own steps behind it
        weight = chained.float() / chained.sum().clamp(min=1)
        logits = draft.logits(hidden[any_step])  # [n, V]
        ce = F.cross_entropy(logits, target, reduction="none")  # [n]
        total = total + STEP_DECAY**step * (ce * weight).sum()
        agree = logits.detach().argmax(-1) == target_top
        metrics[f"acc{step}"] = (agree.float() * weight).sum().item()
    return total, metrics
