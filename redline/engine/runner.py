"""Runs the model over the KV cache: prefill one sequence into a slot, decode one token for every slot.

Decode state (last token, position, active flag, sampling parameters) lives on the device, one row per
slot, and the step updates it in place, so the host only reads the new tokens.
"""

from __future__ import annotations

import torch

from redline.engine.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM
from redline.sampling import SamplingParams, SamplingTensors, select_tokens


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, slots: int, max_len: int, kv_dtype: torch.dtype | None = None
    ):
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        self.cache = KVCache(model.config, slots, max_len, kv_dtype or param.dtype, self.device)
        zeros = dict(device=self.device, dtype=torch.int64)
        self.last_token = torch.zeros(slots, **zeros)  # [S]
        self.pos = torch.zeros(slots, **zeros)  # [S] position of last_token
        self.active = torch.zeros(slots, dtype=torch.bool, device=self.device)  # [S]
        self.sampling = SamplingTensors(
            temperature=torch.zeros(slots, device=self.device),
            top_k=torch.zeros(slots, **zeros),
            top_p=torch.ones(slots, device=self.device),
            seed=torch.zeros(slots, **zeros),
        )
        self.sampling_slots: set[int] = set()  # slots whose request samples (temperature > 0)

    @property
    def slots(self) -> int:
        return self.cache.slots

    @torch.inference_mode()
    def prefill(self, slot: int, prompt_ids: list[int], params: SamplingParams, seed: int) -> int:
        """Runs the prompt into `slot`'s cache and returns the first generated token."""
        n = len(prompt_ids)
        self._set_sampling(slot, params, seed)
        tokens = torch.tensor([prompt_ids], device=self.device)
        positions = torch.arange(n, device=self.device)[None]
        hidden, _ = self.model(tokens, positions, self.cache.layers, slot, self.cache.kv_len_for(n))
        logits = self.model.logits(hidden[:, -1:])  # [1, 1, V]
        row = SamplingTensors(
            *(getattr(self.sampling, f)[slot : slot + 1] for f in SamplingTensors.__annotations__)
        )
        first = select_tokens(logits, row, positions[:, -1:] + 1, not params.greedy)[0, 0]
        self.last_token[slot] = first
        self.pos[slot] = n
        self.active[slot] = True
        return int(first)

    @torch.inference_mode()
    def decode(self, kv_len: int) -> torch.Tensor:
        """One token for every slot (inactive slots compute and are ignored). Returns tokens [S]."""
        positions = self.pos[:, None]  # [S, 1]
        hidden, _ = self.model(self.last_token[:, None], positions, self.cache.layers, 0, kv_len)
        logits = self.model.logits(hidden)  # [S, 1, V]
        tokens = select_tokens(logits, self.sampling, positions + 1, bool(self.sampling_slots))[:, 0]
        self.last_token.copy_(torch.where(self.active, tokens, self.last_token))
        self.pos.add_(self.active.long())
        return tokens

    def release(self, slot: int) -> None:
        self.active[slot] = False
        self.sampling_slots.discard(slot)

    def _set_sampling(self, slot: int, params: SamplingParams, seed: int) -> None:
        s = self.sampling
        s.temperature[slot] = params.temperature
        s.top_k[slot] = params.top_k
        s.top_p[slot] = params.top_p
        s.seed[slot] = (seed ^ (seed >> 32)) & 0xFFFFFFFF
        if not params.greedy:
            self.sampling_slots.add(slot)
