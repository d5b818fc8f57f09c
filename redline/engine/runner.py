"""Owns the device side: model(s), KV caches, per-slot decode state and sampling parameters.

prefill() runs one prompt into a slot (outside the captured step); decode() runs the step for the
slots in use and copies its output to the host once. Every shape the step can run at is known when
the runner is built (step_keys); with compile or CUDA graphs, warm_up() compiles and captures them all
before the first request, so nothing compiles while serving.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from redline.engine.blocks import BlockPool, BlockTable, OutOfBlocks
from redline.engine.compiled_prefill import CompiledPrefill, warm_up_lengths
from redline.engine.compiled_step import CompiledStep
from redline.engine.cuda_graphs import GraphedStep
from redline.engine.kv_cache import BLOCK, KVCache
from redline.kernels.select import (
    compile_by_default,
    pdl_supported,
    select_cpu_paths,
    select_kernels,
    triton_by_default,
)
from redline.models.eagle3 import Eagle3Draft
from redline.models.llama import LlamaForCausalLM
from redline.sampling import SamplingParams, SamplingTensors, select_tokens
from redline.spec.draft_loop import propose
from redline.spec.step import DecodeState, DecodeStep


def batch_bucket(rows_needed: int, slots: int) -> int:
    """Rows a step runs over: the next power of two (1, 2, 4, ...), at most `slots`. 3 -> 4."""
    rows = 1
    while rows < rows_needed:
        rows *= 2
    return min(rows, slots)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        slots: int,
        max_len: int,
        draft: Eagle3Draft | None = None,
        num_draft_tokens: int = 3,
        compile: bool | None = False,  # None: kernels.select.compile_by_default for the device
        pdl: bool = False,
        kv_cache_dtype: torch.dtype | None = None,  # None: the model's dtype; torch.float8_e4m3fn halves it
        cuda_graphs: bool | None = None,  # None: on CUDA devices
        kv_cache_memory: int | None = None,  # bytes of KV blocks (None: every slot's whole context)
    ):
        self.model, self.draft = model, draft
        self.k = num_draft_tokens if draft is not None else 0
        param = next(model.parameters())
        self.device = param.device
        compile = compile_by_default(self.device) if compile is None else compile
        if pdl and not (triton_by_default(self.device) and pdl_supported(self.device)):
            raise ValueError("programmatic dependent launch needs Triton and a Hopper or newer GPU")
        for module in (model, draft):
            if module is not None:
                select_kernels(module, triton_by_default(self.device), pdl)
                select_cpu_paths(module, compile)
        # writes reach pos + K (target) and pos + 2K - 1 (draft chain) beyond the last real token
        self.max_len = max_len  # prompt + output tokens of a request
        self.cache_len = max_len + 2 * self.k + 1
        kv_dtype = kv_cache_dtype or param.dtype
        # a step writes up to pos + 2K (the draft chain): blocks for positions [0, pos + lookahead)
        self.lookahead = 2 * self.k + 2
        configs = [model.config] + ([draft.config.layer] if draft is not None else [])
        self.block_bytes = sum(
            2 * c.num_layers * c.num_kv_heads * BLOCK * c.head_dim * kv_dtype.itemsize for c in configs
        )  # fmt: skip
        self.pool = BlockPool(self._pool_blocks(slots, kv_cache_memory), BLOCK)
        self.block_tables = [BlockTable(self.pool) for _ in range(slots)]
        blocks = self.pool.num_blocks + 1  # and the cache's scratch block (engine/kv_cache.py)
        self.cache = KVCache(model.config, slots, self.cache_len, kv_dtype, self.device, blocks)
        self.draft_cache = None
        if draft is not None:
            layer = draft.config.layer
            self.draft_cache = KVCache(layer, slots, self.cache_len, kv_dtype, self.device, blocks)
            self.draft_cache.table = self.cache.table  # the same positions: the same blocks
        draft_vocab = draft.config.draft_vocab_size if draft is not None else None
        self.state = DecodeState.empty(slots, self.k, draft_vocab, self.device)
        self.sampling = SamplingTensors(
            temperature=torch.zeros(slots, device=self.device),
            top_k=torch.zeros(slots, dtype=torch.int64, device=self.device),
            top_p=torch.ones(slots, device=self.device),
            seed=torch.zeros(slots, dtype=torch.int64, device=self.device),
        )
        self.sampling_slots: set[int] = set()  # slots whose request samples (temperature > 0)
        self.step = DecodeStep(model, draft, self.k, self.cache, self.draft_cache, self.state, self.sampling)
        run: Callable[[int, int, bool], torch.Tensor] = self.step
        self.compiled_prefill = CompiledPrefill(model, self.cache) if compile else None
        self.compiled_step = CompiledStep(run, self.cache_len, self.device) if compile else None
        if self.compiled_step is not None:
            run = self.compiled_step
            limit = len({(rows, sampling) for rows, _, sampling in self.step_keys()})
            limit += 2 * len(warm_up_lengths(self.cache_len, model.token_count_branches()))  # prefill
            # dynamo's limit counts per function, and every runner's graphs hang off the same functions
            dynamo = torch._dynamo.config
            dynamo.recompile_limit += limit
            dynamo.accumulated_recompile_limit = max(
                dynamo.accumulated_recompile_limit, dynamo.recompile_limit
            )
        self.graphed_step = None
        if cuda_graphs if cuda_graphs is not None else self.device.type == "cuda":
            run = self.graphed_step = GraphedStep(run, self.state)
        self._run_step = run
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._host_out = torch.zeros((slots, self.k + 2), dtype=torch.int64, pin_memory=pin)

    @property
    def slots(self) -> int:
        return self.cache.slots

    def _pool_blocks(self, slots: int, kv_cache_memory: int | None) -> int:
        """Blocks of the KV pool: kv_cache_memory / block bytes, or every slot's whole context."""
        if kv_cache_memory is None:
            return slots * -(-self.cache_len // BLOCK)
        blocks = kv_cache_memory // self.block_bytes
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory {kv_cache_memory:,} bytes holds no KV block ({self.block_bytes:,} bytes "
                f"each: {BLOCK} positions of every layer's keys and values, target and draft)"
            )
        return blocks

    def holds(self, slot: int, positions: int) -> bool:
        """Whether `slot` already has blocks for positions [0, positions): reserve would change nothing."""
        return self.block_tables[slot].capacity >= min(positions, self.cache_len)

    def reserve(self, slot: int, positions: int) -> bool:
        """Blocks for positions [0, positions) of `slot`; False, taking none, when the pool is short."""
        table = self.block_tables[slot]
        held = len(table.blocks)
        try:
            table.ensure(min(positions, self.cache_len))
        except OutOfBlocks:
            return False
        if len(table.blocks) > held:
            new = torch.tensor(table.blocks[held:], dtype=torch.int32)
            self.cache.table[slot, held : len(table.blocks)] = new.to(self.device)
        return True

    def kv_len_for(self, last_position: int) -> int:
        """Cache positions a forward must see when the furthest slot's pending token sits at last_position."""
        return self.cache.kv_len_for(last_position + 2 * self.k + 1)

    def step_keys(self) -> list[tuple[int, int, bool]]:
        """Every (rows, kv_len, sampling) the scheduler can ask for: rows a batch bucket (1, 2, 4, ...,
        slots), kv_len a kv bucket (64, 128, ..., cache_len). 16 slots x 4,096 tokens, K = 3: 5 x 8 x 2."""
        rows = sorted({batch_bucket(n, self.slots) for n in range(1, self.slots + 1)})
        kv_lens = sorted({self.kv_len_for(p) for p in range(self.cache_len - 2 * self.k)})
        return [(r, kv, sampling) for r in rows for kv in kv_lens for sampling in (False, True)]

    def warm_up_step_keys(self) -> list[tuple[int, int, bool]]:
        """The step keys warm_up runs: all of them for CUDA graphs (one graph per key), else one per (rows,
        sampling) at the smallest kv bucket: a compiled step has one graph for every kv_len."""
        keys = self.step_keys()
        if self.graphed_step is not None:
            return keys
        smallest_kv: dict[tuple[int, bool], int] = {}
        for rows, kv_len, sampling in keys:
            smallest_kv.setdefault((rows, sampling), kv_len)
        return [(rows, kv_len, sampling) for (rows, sampling), kv_len in smallest_kv.items()]

    @property
    def needs_warm_up(self) -> bool:
        return (
            self.compiled_prefill is not None
            or self.compiled_step is not None
            or self.graphed_step is not None
        )

    @torch.inference_mode()
    def warm_up(self, progress: bool = True) -> None:
        """Compiles the prefill and every step shape (and captures each as a CUDA graph), runs one prompt
        through the eager parts (their Triton kernels compile on first use), then forbids new shapes.
        Runs before any request: free slots compute at position 0 and never advance, the prompt's slot is
        released again, and the KV entries written are rewritten before they are read."""
        work: list[tuple[str, Callable[[], object]]] = []
        if self.compiled_prefill is not None:
            prefill = self.compiled_prefill
            for n in warm_up_lengths(self.cache_len, self.model.token_count_branches()):
                tokens = torch.zeros((1, n), dtype=torch.int64, device=self.device)
                work.append((f"prefill {n}", lambda tokens=tokens: prefill(tokens, 0)))
        for rows, kv_len, sampling in self.warm_up_step_keys():
            work.append((f"step {rows}x{kv_len}", lambda k=(rows, kv_len, sampling): self._run_step(*k)))
        # a whole prompt, the draft's eager priming pass included: on CUDA its Triton kernels compile here
        prompt = [0] * max(1, min(20, self.max_len - 1))

        def run_prompt() -> None:
            if not self.reserve(0, len(prompt) + self.lookahead):
                pool = f"{self.pool.num_blocks} blocks of {BLOCK}"
                raise ValueError(f"the KV pool ({pool}) cannot hold the {len(prompt)}-token warm-up prompt")
            self.prefill_on_device(0, prompt, SamplingParams(), seed=0)

        work.append(("prompt", run_prompt))
        with tqdm(work, desc="compiling" if self.compiled_step else "capturing", disable=not progress) as bar:
            for name, run in bar:
                bar.set_postfix_str(name)
                run()
        self.release(0)
        for stage in (self.compiled_prefill, self.compiled_step, self.graphed_step):
            if stage is not None:
                stage.freeze()

    @torch.inference_mode()
    def prefill(self, slot: int, prompt_ids: list[int], params: SamplingParams, seed: int) -> int:
        """Runs the prompt into `slot`, primes the draft, and returns the first generated token."""
        return int(self.prefill_on_device(slot, prompt_ids, params, seed))

    def prefill_on_device(
        self, slot: int, prompt_ids: list[int], params: SamplingParams, seed: int
    ) -> torch.Tensor:  # [1, 1] the first generated token, on the device (no host sync)
        n = len(prompt_ids)
        if self.block_tables[slot].capacity < n:
            raise RuntimeError(f"slot {slot} holds KV blocks for fewer than {n} positions: reserve() first")
        self._set_sampling(slot, params, seed)
        row = self.sampling.rows(slot, slot + 1)
        tokens = torch.tensor([prompt_ids], device=self.device)
        positions = torch.arange(n, device=self.device)[None]
        kv_len = self.kv_len_for(n)
        if self.compiled_prefill is not None:
            hidden, aux = self.compiled_prefill(tokens, slot)
        else:
            hidden, aux = self.model(tokens, positions, self.cache.layers, self.cache.tables(slot, 1), kv_len)
        if params.greedy:
            first = self.model.greedy_tokens(hidden[:, -1:])  # [1, 1]
        else:
            first = select_tokens(self.model.logits(hidden[:, -1:]), row, positions[:, -1:] + 1, True)
        pending = first
        if self.draft is not None:
            assert self.draft_cache is not None and self.state.draft_probs is not None
            next_tokens = torch.cat((tokens[:, 1:], first), dim=1)  # the row at p reads the token at p + 1
            drafts, probs = propose(
                self.draft,
                aux,
                next_tokens,
                positions,
                torch.tensor([n - 1], device=self.device),
                self.k,
                self.draft_cache.layers[0],
                self.draft_cache.tables(slot, 1),
                kv_len,
                row,
                not params.greedy,
            )
            pending = self.model.tp.from_first_rank(torch.cat((first, drafts), dim=1))  # [1, K + 1]: rank 0's
            first = pending[:, :1]
            if probs is not None:
                self.state.draft_probs[slot] = probs[0]
        self.state.pending[slot] = pending[0]
        self.state.pos[slot] = n
        self.state.active[slot] = True
        return first

    def run_step(self, rows: int, kv_len: int, any_sampling: bool) -> torch.Tensor:
        """One step over slots [0, rows) on the device: [rows, K + 2], emitted tokens then n_acc."""
        return self._run_step(rows, kv_len, any_sampling)

    @torch.inference_mode()
    def decode(self, rows: int, last_position: int) -> list[list[int]]:
        """One step over slots [0, rows). Returns per row its emitted tokens followed by n_acc."""
        out = self.run_step(rows, self.kv_len_for(last_position), bool(self.sampling_slots))
        host = self._host_out[:rows]
        host.copy_(out, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return host.tolist()

    @torch.inference_mode()
    def log_probs(self, tokens: list[int]) -> torch.Tensor:  # [T - 1, V] fp32, on the CPU
        """Log-probabilities of every next token after each prefix of `tokens` (no cache: `redline eval`'s
        perplexity and KL)."""
        inputs = torch.tensor([tokens[:-1]], device=self.device)
        hidden, _ = self.model(inputs, torch.arange(inputs.shape[1], device=self.device)[None])
        return self.model.logits(hidden)[0].log_softmax(-1).cpu()

    def release(self, slot: int) -> None:
        self.state.active[slot] = False
        self.sampling_slots.discard(slot)
        self.block_tables[slot].release()
        self.cache.table[slot] = self.cache.scratch_block

    def _set_sampling(self, slot: int, params: SamplingParams, seed: int) -> None:
        s = self.sampling
        s.temperature[slot] = params.temperature
        s.top_k[slot] = params.top_k
        s.top_p[slot] = params.top_p
        s.seed[slot] = (seed ^ (seed >> 32)) & 0xFFFFFFFF
        if not params.greedy:
            self.sampling_slots.add(slot)
