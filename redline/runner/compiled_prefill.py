"""The target's prefill forward through torch.compile, its batch, chunk length and keys dynamic.

A prefill runs rows of chunks (runner/prefill.py): tokens [B, L] at positions [B, L], L a multiple of 16
(at least 16), attending over cache positions [0, kv_len). B, L and kv_len are dynamic dimensions (kv_len
enters as the length of an empty marker tensor), so a few graphs serve every batch, chunk and offset:
dynamo specializes B = 1 apart from B >= 2, and a model whose forward branches on the token count (a
Llama 4 MoE layer takes its few-token path while B L <= num_experts / top_k:
LlamaForCausalLM.token_count_branches) gets a graph per side of that branch. runner/warm_up.py
compiles them all at start-up (prefill_shapes). After `freeze()` a shape that would still compile runs
the same forward eagerly, with a warning, instead of failing.

Duck shaping is off while tracing: a first call with kv_len == L (a whole prompt) must not tie the two
symbols together, or the first chunk at an offset would compile again.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
import torch.fx.experimental._config as fx_config

from redline.models.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM
from redline.runner.compiling import STANCE, own_copy, remember_isa_probes, room_for
from redline.runner.plan import ALIGN, padded_len

Forwarded = tuple[torch.Tensor, torch.Tensor | None]  # (hidden [B, L, H], aux [B, L, A] or None)


def prefill_shapes(cache_len: int, branches: Iterable[int] = ()) -> list[tuple[int, int]]:
    """(rows, padded length) pairs that compile every prefill graph: for one row and for two, two
    lengths (16 and 32: nothing specializes on the first), and for each token count t at which the
    forward branches, the longest padded batch of up to t tokens and the shortest above it, within the
    cache: t = 128 -> (1, 128), (1, 144), (2, 64), (2, 80); t = 8 -> nothing at or below 8 tokens. Long
    prompts are not run: a 4,097-token warm-up prompt cost SmolLM2 5 s."""
    shapes = set()
    for rows in (1, 2):
        shapes |= {(rows, min(ALIGN, cache_len)), (rows, min(2 * ALIGN, cache_len))}
        for t in branches:
            if t // rows >= ALIGN:
                shapes.add((rows, min(t // rows // ALIGN * ALIGN, cache_len)))
            shapes.add((rows, padded_len(t // rows + 1, cache_len)))
    return sorted(shapes)


def _marker(kv_len: int, device: torch.device) -> torch.Tensor:  # [kv_len] int8, never read
    return torch.empty(kv_len, dtype=torch.int8, device=device)


def _through_marker(model: LlamaForCausalLM, cache: KVCache) -> Callable[..., Forwarded]:
    def forward(
        tokens: torch.Tensor,  # [B, L]
        positions: torch.Tensor,  # [B, L]
        tables: torch.Tensor,  # [B, blocks per sequence] int32
        kv_marker: torch.Tensor,  # [kv_len]: its length is the keys attended (a dynamic dimension)
    ) -> Forwarded:
        return model(tokens, positions, cache.layers, tables, kv_marker.shape[0])

    return forward


class CompiledPrefill:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, graphs: int):
        """graphs: how many the warm-up's shapes compile (two per shape at most)."""
        self.graphs = graphs
        remember_isa_probes()
        self._forward = _through_marker(model, cache)
        self.compiled = torch.compile(own_copy(self._forward), fullgraph=True, dynamic=False)
        self.frozen = False
        # set while another thread compiles the graphs (compile_shape) as this runner serves: calls then
        # run the forward eagerly (runner/background_compile.py)
        self.deferred = False

    def freeze(self) -> None:
        """From now on a call that would compile runs eagerly instead, with a warning."""
        self.frozen = True

    def __call__(
        self,
        tokens: torch.Tensor,  # [B, L] token ids, L a multiple of 16
        positions: torch.Tensor,  # [B, L] absolute positions
        tables: torch.Tensor,  # [B, blocks per sequence] int32
        kv_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's (hidden [B, L, H], aux [B, L, A] or None), keys and values written through
        `tables` at `positions`."""
        if self.deferred:
            return self._forward(tokens, positions, tables, _marker(kv_len, tokens.device))
        return self.compile_shape(tokens, positions, tables, kv_len)

    def compile_shape(
        self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As a call, compiling the graph for these shapes if none serves them yet (and not frozen)."""
        marker = _marker(kv_len, tokens.device)
        # maybe_: a forward may branch on the token count (the MoE's few-token path), which narrows a
        # dimension's range; each side then gets its own graph (prefill_shapes lists both for the warm-up)
        for tensor, dims in ((tokens, (0, 1)), (positions, (0, 1)), (tables, (0,)), (marker, (0,))):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        try:
            with (
                STANCE,
                torch.compiler.set_stance("fail_on_recompile" if self.frozen else "default"),
                fx_config.patch(use_duck_shape=False),
                room_for(self.graphs),
            ):
                return self.compiled(tokens, positions, tables, marker)
        except RuntimeError as error:  # torch raises a plain RuntimeError for the stance
            if not (self.frozen and "fail_on_recompile" in str(error)):
                raise
            shape = f"{tokens.shape[0]} x {tokens.shape[1]}-token"
            message = f"a {shape} prefill needs a graph the warm-up did not compile; it runs eagerly"
            warnings.warn(message, stacklevel=2)
            return self._forward(tokens, positions, tables, marker)
