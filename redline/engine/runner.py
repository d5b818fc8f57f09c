"""Owns the device side: model(s), KV caches, per-slot decode state and sampling parameters.

admit() gives a request's slot its KV blocks (reusing cached prefix blocks); prefill_batch() runs
chunks of prompts (engine/prefill.py), outside the captured step; decode() runs the step for the slots
in use and copies its output to the host once. Every shape the step can run at is known when
the runner is built (step_keys); with compile or CUDA graphs, warm_up() compiles and captures them all
before the first request, so nothing compiles while serving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from tqdm import tqdm

from redline import logprobs
from redline.engine import kv_budget
from redline.engine.blocks import BlockPool, BlockTable, OutOfBlocks
from redline.engine.compiled_prefill import CompiledPrefill, warm_up_shapes
from redline.engine.compiled_step import CompiledStep
from redline.engine.cuda_graphs import GraphedStep
from redline.engine.kv_cache import BLOCK, KVCache
from redline.engine.prefill import PaddedChunks, PrefillChunk, PrefillResult, pad_chunks
from redline.kernels.select import (
    compile_by_default,
    pdl_supported,
    select_cpu_paths,
    select_kernels,
    triton_by_default,
)
from redline.logprobs import TokenLogprob
from redline.models.eagle3 import Eagle3Draft
from redline.models.llama import LlamaForCausalLM
from redline.penalties import count_emitted, penalize
from redline.sampling import SamplingParams, SamplingTensors, select_tokens
from redline.spec.draft_loop import propose
from redline.spec.step import DecodeState, DecodeStep

PROMPT_LOGPROB_ROWS = 512  # prompt logprobs: rows of logits computed at a time ([512, V] fp32)


class DevicePrefill(NamedTuple):
    """A prefill forward's results, still on the device."""

    first: torch.Tensor  # [B] each chunk's candidate first token (meaningful for final chunks)
    first_logprobs: torch.Tensor | None  # [B, W] on the logits path: the first tokens' packed logprobs
    prompt_logprobs: dict[int, tuple[torch.Tensor, list[int]]]  # chunk index -> packed [n, W], tokens [n]


class StepOutput(NamedTuple):
    tokens: list[list[int]]  # per row: emitted tokens [K + 1], then n_acc
    logprobs: dict[int, list[TokenLogprob]]  # slots asking for logprobs: their first n_acc + 1 tokens'


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
        prefix_caching: bool = True,  # reuse the KV blocks of prompt prefixes computed before
        gpu_memory_utilization: float = 0.9,  # CUDA without kv_cache_memory: the share of the device's memory
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
        self.prefix_caching = prefix_caching
        # the decode state first: its per-slot penalty counts ([slots, V]) count as memory in use for the KV
        # budget measured next
        draft_vocab = draft.config.draft_vocab_size if draft is not None else None
        vocab = model.config.vocab_size
        self.state = DecodeState.empty(slots, self.k, vocab, draft_vocab, self.device)
        self.sampling = SamplingTensors.zeros(slots, self.device)
        # a draft's row at p reads the token at p + 1: its blocks are keyed with the token after them
        blocks = self._pool_blocks(slots, kv_cache_memory, gpu_memory_utilization)
        self.pool = BlockPool(blocks, BLOCK, int(draft is not None))
        self.block_tables = [BlockTable(self.pool) for _ in range(slots)]
        blocks = self.pool.num_blocks + 1  # and the cache's scratch block (engine/kv_cache.py)
        self.cache = KVCache(model.config, slots, self.cache_len, kv_dtype, self.device, blocks)
        self.draft_cache = None
        if draft is not None:
            layer = draft.config.layer
            self.draft_cache = KVCache(layer, slots, self.cache_len, kv_dtype, self.device, blocks)
            self.draft_cache.table = self.cache.table  # the same positions: the same blocks
        # slots whose request needs the logits path: it samples, has penalties or asks for logprobs
        self.sampling_slots: set[int] = set()
        self.logprob_slots: dict[int, int] = {}  # slot -> top logprobs its request reports per token
        self.prompt_logprob_slots: dict[int, tuple[int, int]] = {}  # slot -> (top logprobs, prompt length)
        self.prefilled_tokens = 0  # prompt positions computed by prefill (prefix-cache hits are not)
        self.step = DecodeStep(model, draft, self.k, self.cache, self.draft_cache, self.state, self.sampling)
        run: Callable[[int, int, bool], torch.Tensor] = self.step
        self.compiled_prefill = CompiledPrefill(model, self.cache) if compile else None
        self.compiled_step = CompiledStep(run, self.cache_len, self.device) if compile else None
        if self.compiled_step is not None:
            run = self.compiled_step
            limit = len({(rows, sampling) for rows, _, sampling in self.step_keys()})
            limit += 2 * len(warm_up_shapes(self.cache_len, model.token_count_branches()))  # prefill
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
        width = self.k + 2 + (self.k + 1) * logprobs.width(vocab)  # the logits path's output
        self._host_out_logprobs = torch.zeros((slots, width), dtype=torch.int64, pin_memory=pin)

    @property
    def slots(self) -> int:
        return self.cache.slots

    def _pool_blocks(self, slots: int, kv_cache_memory: int | None, gpu_memory_utilization: float) -> int:
        """Blocks of the KV pool: kv_cache_memory / block bytes, or by default (engine/kv_budget.py) on CUDA
        a share of the device's memory, on CPU every slot's whole context up to 4 GiB."""
        one_context = -(-self.cache_len // BLOCK)
        if kv_cache_memory is None and self.device.type != "cuda":
            return kv_budget.cpu_kv_blocks(slots * one_context, one_context, self.block_bytes)
        if kv_cache_memory is None:
            kv_cache_memory = kv_budget.measured_cuda_kv_bytes(
                self.device, gpu_memory_utilization, self._largest_prefill
            )
        blocks = kv_cache_memory // self.block_bytes
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory {kv_cache_memory:,} bytes holds no KV block ({self.block_bytes:,} bytes "
                f"each: {BLOCK} positions of every layer's keys and values, target and draft)"
            )
        return blocks

    @torch.inference_mode()
    def _largest_prefill(self) -> None:
        """A prefill forward of up to kv_budget.PROFILED_TOKENS tokens without a cache: the activation peak
        the budget leaves room for (the draft's, over the same tokens, is smaller)."""
        n = min(self.cache_len, kv_budget.PROFILED_TOKENS)
        tokens = torch.zeros((1, n), dtype=torch.int64, device=self.device)
        hidden, _ = self.model(tokens, torch.arange(n, device=self.device)[None])
        self.model.logits(hidden[:, -1:])

    def holds(self, slot: int, positions: int) -> bool:
        """Whether `slot` already has blocks for positions [0, positions): reserve would change nothing."""
        return self.block_tables[slot].capacity >= min(positions, self.cache_len)

    def reserve(self, slot: int, positions: int) -> bool:
        """Blocks for positions [0, positions) of `slot`; False, taking none, when the pool is short."""
        held = len(self.block_tables[slot].blocks)
        if not self._ensure(slot, positions):
            return False
        self._write_table(slot, held)
        return True

    def _ensure(self, slot: int, positions: int) -> bool:
        try:
            self.block_tables[slot].ensure(min(positions, self.cache_len))
        except OutOfBlocks:
            return False
        return True

    def admit(
        self, slot: int, tokens: list[int], params: SamplingParams, seed: int, prompt_len: int | None = None
    ) -> int | None:
        """Gives a new request's `slot` the blocks of its tokens and a step's lookahead: the cached blocks
        of its longest cached prefix (with prefix caching), then new ones. Returns how many of its tokens
        are already in the cache (its prefill starts there), or None, taking nothing, when the pool is
        short. tokens[:prompt_len] is the prompt (default: all), the rest its outputs so far (a preempted
        request's). A request asking for prompt logprobs computes its whole prompt (no cached prefix)."""
        prompt_len = len(tokens) if prompt_len is None else prompt_len
        table = self.block_tables[slot]
        reuse = self.prefix_caching and params.prompt_logprobs is None
        cached = table.reuse_prefix(tokens) if reuse else 0
        if not self._ensure(slot, len(tokens) + self.lookahead):
            table.release()
            return None
        if reuse:
            table.count_lookup(tokens)
        self._write_table(slot, 0)
        self._set_sampling(slot, params, seed)
        if params.penalized:
            self._set_penalties(slot, tokens, prompt_len)
        if params.prompt_logprobs is not None:
            self.prompt_logprob_slots[slot] = (params.prompt_logprobs, prompt_len)
        return cached

    def _set_penalties(self, slot: int, tokens: list[int], prompt_len: int) -> None:
        """The slot's prompt-token mask and generated-token counts (penalties.py)."""
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        self.state.seen[slot] = False
        self.state.seen[slot, ids[:prompt_len]] = True
        self.state.counts[slot] = torch.bincount(ids[prompt_len:], minlength=self.state.counts.shape[1])

    def _write_table(self, slot: int, first: int) -> None:
        """Copies the slot's blocks from index `first` on into its row of the device's block table."""
        blocks = self.block_tables[slot].blocks
        if len(blocks) > first:
            new = torch.tensor(blocks[first:], dtype=torch.int32)
            self.cache.table[slot, first : len(blocks)] = new.to(self.device)

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
            for rows, n in warm_up_shapes(self.cache_len, self.model.token_count_branches()):
                if rows <= self.slots:  # free slots' tables: every write lands in the scratch block
                    work.append(
                        (f"prefill {rows}x{n}", lambda rows=rows, n=n: self._warm_up_prefill(rows, n))
                    )
        for rows, kv_len, sampling in self.warm_up_step_keys():
            work.append((f"step {rows}x{kv_len}", lambda k=(rows, kv_len, sampling): self._run_step(*k)))
        # a whole prompt, the draft's eager priming pass included: on CUDA its Triton kernels compile here
        prompt = [0] * max(1, min(20, self.max_len - 1))

        def run_prompt() -> None:
            if not self.reserve(0, len(prompt) + self.lookahead):
                pool = f"{self.pool.num_blocks} blocks of {BLOCK}"
                raise ValueError(f"the KV pool ({pool}) cannot hold the {len(prompt)}-token warm-up prompt")
            self.prefill(0, prompt, SamplingParams(), seed=0)

        work.append(("prompt", run_prompt))
        caching, self.prefix_caching = self.prefix_caching, False  # the warm-up prompt is no prefix
        with tqdm(work, desc="compiling" if self.compiled_step else "capturing", disable=not progress) as bar:
            for name, run in bar:
                bar.set_postfix_str(name)
                run()
        self.prefix_caching = caching
        self.release(0)
        for stage in (self.compiled_prefill, self.compiled_step, self.graphed_step):
            if stage is not None:
                stage.freeze()

    def _warm_up_prefill(self, rows: int, length: int) -> None:
        """One compiled prefill of `rows` x `length` tokens over free slots' tables (the scratch block)."""
        assert self.compiled_prefill is not None
        tokens = torch.zeros((rows, length), dtype=torch.int64, device=self.device)
        positions = torch.arange(length, device=self.device).expand(rows, -1).contiguous()
        tables = self.cache.table[torch.arange(rows, device=self.device)]
        self.compiled_prefill(tokens, positions, tables, min(length + BLOCK, self.cache_len))

    @torch.inference_mode()
    def prefill(self, slot: int, prompt_ids: list[int], params: SamplingParams, seed: int) -> int:
        """Runs a whole prompt into `slot` (reserved before), primes the draft, and returns the first
        generated token."""
        self._set_sampling(slot, params, seed)
        first = self.prefill_batch([PrefillChunk(slot, list(prompt_ids), 0, len(prompt_ids))])[0].first
        assert first is not None
        return first

    @torch.inference_mode()
    def prefill_batch(self, chunks: list[PrefillChunk]) -> list[PrefillResult]:
        """Runs the chunks as one forward (slots admitted before). Returns, per chunk, the first generated
        token of a final chunk (its slot now decodes) or None, with the log-probabilities its request asks
        for. Final chunks' full blocks go to the prefix cache."""
        device = self.prefill_on_device(chunks)
        firsts = device.first.tolist()
        wanted = device.first_logprobs is not None and any(c.slot in self.logprob_slots for c in chunks)
        packed = device.first_logprobs.cpu() if wanted else None
        out: list[PrefillResult] = []
        for i, (chunk, first) in enumerate(zip(chunks, firsts, strict=True)):
            if chunk.final and self.prefix_caching:
                self.block_tables[chunk.slot].cache_prompt([*chunk.tokens, first], len(chunk.tokens))
            result = PrefillResult(first if chunk.final else None)
            if chunk.final and chunk.slot in self.logprob_slots and packed is not None:
                result.logprob = logprobs.unpack(
                    packed[i].view(1, -1), [first], self.logprob_slots[chunk.slot]
                )[0]
            if i in device.prompt_logprobs:
                packed_rows, tokens = device.prompt_logprobs[i]
                top = self.prompt_logprob_slots[chunk.slot][0]
                result.prompt_logprobs = logprobs.unpack(packed_rows.cpu(), tokens, top)
            out.append(result)
        return out

    def _prompt_logprobs(
        self, chunk: PrefillChunk, hidden: torch.Tensor, next_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """One chunk's prompt log-probabilities, packed [n, W] on the device, and the n tokens they are of:
        the prompt tokens at positions [start + 1, min(end + 1, prompt length)). Row i predicts the token at
        start + i + 1; the last row of a final chunk predicts the first generated token, not a prompt token.
        hidden [L, H], next_tokens [L]; logits are computed PROMPT_LOGPROB_ROWS rows at a time."""
        _, prompt_len = self.prompt_logprob_slots[chunk.slot]
        count = max(min(chunk.end + 1, prompt_len) - (chunk.start + 1), 0)
        pieces = []
        for start in range(0, count, PROMPT_LOGPROB_ROWS):
            rows = slice(start, min(start + PROMPT_LOGPROB_ROWS, count))
            logits = self.model.logits(hidden[None, rows])  # [1, n, V]
            pieces.append(logprobs.pack(logits, next_tokens[None, rows]).view(logits.shape[1], -1))
        width = logprobs.width(self.model.config.vocab_size)
        packed = torch.cat(pieces) if pieces else torch.zeros((0, width), dtype=torch.int64)
        return packed, chunk.tokens[chunk.start + 1 : chunk.start + 1 + count]

    def prefill_on_device(self, chunks: list[PrefillChunk]) -> DevicePrefill:
        """prefill_batch without the host: computed on the device without a sync."""
        for c in chunks:
            if self.block_tables[c.slot].capacity < c.end:
                raise RuntimeError(
                    f"slot {c.slot} holds KV blocks for fewer than {c.end} positions: admit first"
                )
        batch = pad_chunks(chunks, self.cache_len, self.device)
        self.prefilled_tokens += sum(c.end - c.start for c in chunks)
        slots = torch.tensor([c.slot for c in chunks], device=self.device)
        tables = self.cache.table[slots]  # [B, blocks per sequence]
        if self.compiled_prefill is not None:
            hidden, aux = self.compiled_prefill(batch.tokens, batch.positions, tables, batch.kv_len)
        else:
            hidden, aux = self.model(batch.tokens, batch.positions, self.cache.layers, tables, batch.kv_len)
        prompt = {
            i: self._prompt_logprobs(c, hidden[i], batch.next_tokens[i])
            for i, c in enumerate(chunks)
            if c.slot in self.prompt_logprob_slots
        }
        if not any(c.final for c in chunks):  # keys and values only: no first token, no proposals yet
            if self.draft is not None:
                assert self.draft_cache is not None and aux is not None
                layer = self.draft_cache.layers[0]
                self.draft(
                    batch.next_tokens, self.draft.fuse(aux), batch.positions, layer, tables, batch.kv_len
                )
            return DevicePrefill(
                torch.zeros(len(chunks), dtype=torch.int64, device=self.device), None, prompt
            )
        return self._first_tokens(chunks, batch, slots, tables, hidden, aux)._replace(prompt_logprobs=prompt)

    def _first_tokens(
        self,
        chunks: list[PrefillChunk],
        batch: PaddedChunks,
        slots: torch.Tensor,  # [B]
        tables: torch.Tensor,  # [B, blocks per sequence]
        hidden: torch.Tensor,  # [B, L, H]
        aux: torch.Tensor | None,  # [B, L, 3 * H] with a draft
    ) -> DevicePrefill:
        """Each chunk's first new token from its last row (meaningful for final chunks), and the final
        chunks' slots set to decode: pending tokens (with the draft's proposals), positions, counts."""
        last = batch.last[:, None]  # [B, 1]
        h_last = hidden.gather(1, last[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, 1, H]
        sampling = self.sampling.take(slots)
        any_sampling = any(c.slot in self.sampling_slots for c in chunks)
        final = torch.tensor([c.final for c in chunks], device=self.device)[:, None]  # [B, 1]
        packed = counts = None
        if any_sampling:
            position = batch.positions.gather(1, last) + 1  # [B, 1] where the first new token goes
            logits = self.model.logits(h_last)  # [B, 1, V]
            counts = self.state.counts[slots]  # [B, V]
            penalized = penalize(logits, sampling, counts[:, None], self.state.seen[slots])
            first = select_tokens(penalized, sampling, position, True)
            packed = logprobs.pack(logits, first)  # [B, W]
            count_emitted(counts, first, final)  # final chunks' first tokens count for their penalties
        else:
            first = self.model.greedy_tokens(h_last)  # [B, 1]
        pending, probs = first, None
        if self.draft is not None:
            assert self.draft_cache is not None and aux is not None
            # the last row of a final chunk reads the first new token; other rows read their next token
            next_tokens = batch.next_tokens.scatter(
                1, last, torch.where(final, first, batch.next_tokens.gather(1, last))
            )
            # the proposals run K - 1 positions past the last row
            kv_len = min(max(batch.kv_len, max(c.end for c in chunks) + 2 * self.k + 1), self.cache_len)
            cache = self.draft_cache.layers[0]
            penalties = None if counts is None else (counts, self.state.seen[slots])
            drafts, probs = propose(self.draft, aux, next_tokens, batch.positions, batch.last, self.k, cache,
                                    tables, kv_len, sampling, any_sampling, penalties)  # fmt: skip
            pending = self.model.tp.from_first_rank(torch.cat((first, drafts), dim=1))  # [B, K + 1]: rank 0's
            first = pending[:, :1]
        rows = [i for i, c in enumerate(chunks) if c.final]
        index = torch.tensor(rows, device=self.device)
        done = slots[index]  # these slots decode from now on
        self.state.pending[done] = pending[index]
        self.state.pos[done] = torch.tensor([chunks[i].end for i in rows], device=self.device)
        self.state.active[done] = True
        if probs is not None and self.state.draft_probs is not None:
            self.state.draft_probs[done] = probs[index]
        if counts is not None:  # last: a prefill that raises before here leaves the counts as they were
            self.state.counts[slots] = counts
        return DevicePrefill(first[:, 0], packed, {})

    def run_step(self, rows: int, kv_len: int, any_sampling: bool) -> torch.Tensor:
        """One step over slots [0, rows) on the device: [rows, K + 2], emitted tokens then n_acc, and on
        the logits path (any_sampling) their packed log-probabilities after them (spec/step.py)."""
        return self._run_step(rows, kv_len, any_sampling)

    @torch.inference_mode()
    def decode(self, rows: int, last_position: int) -> StepOutput:
        """One step over slots [0, rows): per row its emitted tokens followed by n_acc, and the accepted
        tokens' log-probabilities of the slots asking for them."""
        out = self.run_step(rows, self.kv_len_for(last_position), bool(self.sampling_slots))
        width = self.k + 2
        if not self.logprob_slots:  # the packed log-probabilities stay on the device
            out = out[:, :width]
        host = (self._host_out if out.shape[1] == width else self._host_out_logprobs)[:rows]
        host.copy_(out, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        tokens = host[:, :width].tolist()
        chosen: dict[int, list[TokenLogprob]] = {}
        for slot, top in self.logprob_slots.items():
            if slot < rows:
                *emitted, n_acc = tokens[slot]
                packed = host[slot, width:].view(self.k + 1, -1)
                chosen[slot] = logprobs.unpack(packed, emitted[: n_acc + 1], top)
        return StepOutput(tokens, chosen)

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
        self.logprob_slots.pop(slot, None)
        self.prompt_logprob_slots.pop(slot, None)
        self.block_tables[slot].release()
        self.cache.table[slot] = self.cache.scratch_block

    def _set_sampling(self, slot: int, params: SamplingParams, seed: int) -> None:
        s = self.sampling
        s.temperature[slot] = params.temperature
        s.top_k[slot] = params.top_k
        s.top_p[slot] = params.top_p
        s.min_p[slot] = params.min_p
        s.presence[slot] = params.presence_penalty
        s.frequency[slot] = params.frequency_penalty
        s.repetition[slot] = params.repetition_penalty
        s.seed[slot] = (seed ^ (seed >> 32)) & 0xFFFFFFFF
        if params.needs_logits:
            self.sampling_slots.add(slot)
        if params.logprobs is not None:
            self.logprob_slots[slot] = params.logprobs
