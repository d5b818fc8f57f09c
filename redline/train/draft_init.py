"""A fresh EAGLE-3 draft's weights taken from its target, so that training starts from a layer that already
computes something useful rather than from noise.

The draft's one layer reads [embedding, fused hidden state] (2H wide); it starts as the target's last
decoder layer applied to the fused hidden state: the hidden half of q/k/v is that layer's projections, the
embedding half small noise, o_proj, the MLP and the norms are its own, and fc starts by passing the highest
aux hidden state through (the input of layer L - 3, the nearest to the last layer's own input). The final
norm is the target's, and lm_head the target's rows of the draft vocabulary (as for a random draft).
"""

from __future__ import annotations

import torch

from redline.models.eagle3 import Eagle3Draft
from redline.models.llama import LlamaForCausalLM


@torch.no_grad()
def init_from_target(draft: Eagle3Draft, target: LlamaForCausalLM) -> None:
    """Copies the target's last layer (and final norm) into `draft` in place; shapes must match the
    target's (draft_config_for with the target's intermediate size)."""
    last = target.model.layers[-1]
    layer, attention, h = draft.midlayer, draft.midlayer.self_attn, draft.config.target_hidden_size
    wanted, given = target.config.intermediate_size, draft.config.layer.intermediate_size
    if wanted != given:
        raise ValueError(f"init from the target needs the target's intermediate size {wanted}, not {given}")
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(attention, name).weight  # [out, 2H]: [embedding half | hidden half]
        weight[:, :h] *= 0.1
        weight[:, h:] = getattr(last.self_attn, name).weight
    attention.o_proj.weight.copy_(last.self_attn.o_proj.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(layer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
    layer.hidden_norm.weight.copy_(last.input_layernorm.weight)
    layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
    draft.norm.weight.copy_(target.model.norm.weight)
    aux = draft.fc.weight.shape[1] // h  # [H, aux * H]: the last block passes its hidden state through
    draft.fc.weight.zero_()
    draft.fc.weight[:, (aux - 1) * h :] = torch.eye(h)
