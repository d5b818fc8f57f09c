"""Executes step plans on one rank's device: the model(s), the KV caches, the per-slot state, the step.

`execute(plan)` applies the plan's set-up (runner/slots.py), runs its prefill forward and its decode step
on the device, then reads both back with one wait: the prefill's first tokens and the step's output copy
to the host after the step is launched. The runner holds no scheduling state: which request is in which
slot, which blocks it holds and what decodes are the scheduler's (engine/scheduler.py), told through the
plan. Every shape a step can run at is known when the runner is built (Shapes); compiled and captured
stages (compiled_step.py, compiled_prefill.py, cuda_graphs.py) wrap the step and the prefill forward,
and warm_up.py compiles them all before the first request.
"""

from __future__ import annotations

import time

import torch

from redline import logprobs
from redline.kernels.paged_kv import BLOCK
from redline.models.eagle3 import Eagle3Draft
from redline.models.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM
from redline.runner import kv_budget
from redline.runner.compiled_prefill import CompiledPrefill, prefill_shapes
from redline.runner.compiled_step import CompiledStep, Step
from redline.runner.cuda_graphs import GraphedStep
from redline.runner.plan import DecodeBatch, DecodeResult, Shapes, StageError, StepPlan, StepResult
from redline.runner.prefill import DevicePrefill, Prefill
from redline.runner.slots import DeviceSlots
from redline.sampling import SamplingTensors
from redline.speculative.deferred_keys import DEFERRED, DeferredKeys
from redline.speculative.emit import Emitter
from redline.speculative.step import DecodeState, DecodeStep
from redline.speculative.tree_step import TreeDecodeStep


class ModelRunner:
    recovers = True  # one process: a failed stage leaves the state of every other slot whole

    def __init__(
        self,
        model: LlamaForCausalLM,
        shapes: Shapes,
        draft: Eagle3Draft | None = None,
        compile: bool = False,
        cuda_graphs: bool | None = None,  # None: on CUDA devices
        kv_cache_dtype: torch.dtype | None = None,  # None: the model's; torch.float8_e4m3fn halves it
        kv_cache_memory: int | None = None,  # bytes of KV blocks (None: engine defaults, kv_budget.py)
        gpu_memory_utilization: float = 0.9,  # CUDA without kv_cache_memory: the device's share
        kv_of: ModelRunner | None = None,  # a runner of the same model whose KV pool this one shares
        compile_sampling: bool = True,  # False: the logits path's steps run `step` eagerly, never built
    ):
        """shapes.k > 0 needs a draft, n-gram lookup (shapes.ngram) or both. The model's layers got their
        kernels when they were built (layers/backends.py); compile wraps the step and the prefill in
        torch.compile. With kv_of, this runner reads and writes that runner's KV blocks (its own block
        table, state and sampling tensors: runner/background_compile.py builds a compiled twin of an eager
        runner this way)."""
        drafters = (draft is not None) + (shapes.ngram is not None)
        if (drafters == 0) != (shapes.k == 0):
            raise ValueError(f"draft length {shapes.k} with {'no' if drafters == 0 else 'a'} draft or n-gram "
                             "lookup")  # fmt: skip
        self.model, self.draft, self.shapes = model, draft, shapes
        norm = model.model.norm.weight  # the model's dtype (a quantized table or head is int8 or uint8)
        self.device, kv_dtype = norm.device, kv_cache_dtype or norm.dtype
        configs = [model.config] + ([draft.config.layer] if draft is not None else [])
        self.block_bytes = sum(
            2 * c.num_layers * c.num_kv_heads * BLOCK * c.head_dim * kv_dtype.itemsize for c in configs
        )  # fmt: skip
        # the decode state first: its per-slot penalty counts ([slots, V]) count as memory in use for the KV
        # budget measured next
        draft_vocab = draft.config.draft_vocab_size if draft is not None else None
        history_len = None if shapes.ngram is None else shapes.cache_len
        nodes = None if shapes.tree is None else shapes.tree.nodes
        vocab = model.config.vocab_size
        state = DecodeState.empty(shapes.slots, shapes.k, vocab, draft_vocab, self.device, history_len, nodes)
        sampling = SamplingTensors.zeros(shapes.slots, self.device, state.pending.shape[1], vocab)
        # steps without drafts leave the draft's keys to a pass every DEFERRED of them (deferred_keys.py)
        self.deferred = DeferredKeys.for_draft(draft, shapes.slots, 0 in shapes.variants, self.device)
        self._deferred_steps = self._deferred_rows = 0  # such steps since the last pass; their widest batch
        self._flushed = False  # the last step began with that pass (its time is not the step's)
        if kv_of is None:
            self.num_blocks = self._pool_blocks(kv_cache_memory, gpu_memory_utilization)
        else:
            self.num_blocks = kv_of.num_blocks
        blocks = self.num_blocks + 1  # and the cache's scratch block
        target_layers = draft_layers = None
        if kv_of is not None:
            target_layers = kv_of.cache.layers
            draft_layers = None if kv_of.slots.draft_cache is None else kv_of.slots.draft_cache.layers
        cache = KVCache(model.config, shapes.slots, shapes.cache_len, kv_dtype, self.device, blocks,
                        target_layers)  # fmt: skip
        draft_cache = None
        if draft is not None:
            draft_cache = KVCache(draft.config.layer, shapes.slots, shapes.cache_len, kv_dtype, self.device,
                                  blocks, draft_layers)  # fmt: skip
            draft_cache.table = cache.table  # the same positions: the same blocks
        self.slots = DeviceSlots(cache, draft_cache, state, sampling)
        graphed = cuda_graphs if cuda_graphs is not None else self.device.type == "cuda"
        # requests' rules on the draft's proposals: a host callback, which a CUDA graph cannot make and other
        # ranks cannot answer (structured/draft_masks.py)
        self.masks_drafts = draft is not None and not graphed and model.tp.size == 1
        emitter = Emitter(model, draft, shapes.k, shapes.ngram, shapes.tree, self.masks_drafts)
        step = DecodeStep if shapes.tree is None else TreeDecodeStep
        self.step: DecodeStep = step(emitter, cache, draft_cache, state, sampling, self.deferred)
        self.compiled_prefill = self.compiled_step = self.graphed_step = None
        forward = lambda tokens, positions, tables, kv_len: model(
            tokens, positions, cache.layers, tables, kv_len
        )
        if compile:
            prefill_graphs = 2 * len(prefill_shapes(shapes.cache_len, model.token_count_branches()))
            forward = self.compiled_prefill = CompiledPrefill(model, cache, prefill_graphs)
        self.compile_sampling = compile_sampling
        self._run_step = self._built_step(compile, graphed, state)
        self.prefill = Prefill(emitter, forward, self.slots, shapes)
        self._launched = 0.0  # when the last decode step was launched (perf_counter)
        self._host_tokens, self._host_logprobs = self._host_buffers()

    def _built_step(self, compile: bool, graphed: bool, state: DecodeState) -> Step:
        """The step as it runs: eager, compiled (one graph per (rows, logits, k) built), captured, or both;
        without compile_sampling, the logits path's steps eager beside the built ones (_logits_path_eager)."""
        run: Step = self.step
        if compile:
            graphs = len({(rows, logits, k) for rows, _, logits, k in self.built_step_keys()})
            run = self.compiled_step = CompiledStep(self.step, self.shapes.cache_len, self.device, graphs)
        if graphed:
            run = self.graphed_step = GraphedStep(run, state)
        return run if self.compile_sampling or run is self.step else _logits_path_eager(run, self.step)

    def built_step_keys(self) -> list[tuple[int, int, bool, int]]:
        """The step keys compiled or captured (Shapes.step_keys): all, or without compile_sampling those off
        the logits path."""
        keys = self.shapes.step_keys()  # (rows, kv_len, logits, k)
        return [key for key in keys if self.compile_sampling or not key[2]]

    def _host_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a step's output is read to: [slots, K + 2] tokens and n_acc, and on the logits path those
        columns then the K + 1 tokens' packed log-probabilities (pinned on CUDA)."""
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        slots, k = self.shapes.slots, self.shapes.k
        width = k + 2 + (k + 1) * logprobs.width(self.model.config.vocab_size)
        tokens = torch.zeros((slots, k + 2), dtype=torch.int64, pin_memory=pin)
        return tokens, torch.zeros((slots, width), dtype=torch.int64, pin_memory=pin)

    @torch.inference_mode()
    def run_step(self, rows: int, kv_len: int, any_sampling: bool, k: int | None = None) -> torch.Tensor:
        """The decode step over slots [0, rows) verifying k drafts (None: K) as the engine runs it: eager
        (`step`), compiled or captured. Returns what DecodeStep does: [rows, K + 2 (+ the packed logprobs
        on the logits path)]."""
        k = self.shapes.k if k is None else k
        self._flushed = False
        if self.deferred is not None:
            if self._deferred_steps and (k > 0 or self._deferred_steps == DEFERRED):
                self.write_deferred_keys()  # a drafting step attends to them; or the ring is full
                self._flushed = True
            if k == 0:  # counted first: a step that raises may have kept its entries
                self._deferred_steps += 1
                self._deferred_rows = max(self._deferred_rows, rows)
        return self._run_step(rows, kv_len, any_sampling, k)

    @torch.inference_mode()
    def write_deferred_keys(self) -> None:
        """The draft's keys that steps without drafts left for later, written now (eagerly: one pass every
        DEFERRED steps costs less than its own graphs' compile and warm-up)."""
        if not self._deferred_steps:
            return
        assert self.deferred is not None and self.draft is not None and self.slots.draft_cache is not None
        cache = self.slots.cache
        self.deferred.flush(self.draft, self.slots.draft_cache.layers[0], cache.table, cache.scratch_block,
                            self._deferred_rows)  # fmt: skip
        self._deferred_steps, self._deferred_rows = 0, 0

    @property
    def cache(self) -> KVCache:
        return self.slots.cache

    @property
    def state(self) -> DecodeState:
        return self.slots.state

    def _pool_blocks(self, kv_cache_memory: int | None, gpu_memory_utilization: float) -> int:
        """Blocks of the KV pool: kv_cache_memory / block bytes, or by default (runner/kv_budget.py) on CUDA
        a share of the device's memory, on CPU every slot's whole context up to 4 GiB."""
        one_context = -(-self.shapes.cache_len // BLOCK)
        if kv_cache_memory is None and self.device.type != "cuda":
            whole = self.shapes.slots * one_context
            return self.model.tp.min_int(kv_budget.cpu_kv_blocks(whole, one_context, self.block_bytes))
        if kv_cache_memory is None:
            kv_cache_memory = kv_budget.measured_cuda_kv_bytes(
                self.device, gpu_memory_utilization, self._largest_prefill
            )
        blocks = self.model.tp.min_int(kv_cache_memory // self.block_bytes)  # every rank's pool alike
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
        n = min(self.shapes.cache_len, kv_budget.PROFILED_TOKENS)
        tokens = torch.zeros((1, n), dtype=torch.int64, device=self.device)
        hidden, _ = self.model(tokens, torch.arange(n, device=self.device)[None])
        self.model.logits(hidden[:, -1:])

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs the plan; a stage that raises raises StageError naming it (its cause chained): "setup",
        "prefill", "decode step" (carrying the prefill's results), or "read" when reading the results back
        failed after the device ran everything (the device state is then unknown)."""
        try:
            if plan.released and self.deferred is not None:  # their requests' keys are never read again
                self.deferred.drop(plan.released)
            self.slots.apply(plan)
        except Exception as error:
            raise StageError("setup") from error
        prefilled: DevicePrefill | None = None
        if plan.prefill is not None:
            try:
                prefilled = self.prefill.run(plan.prefill)
            except Exception as error:
                raise StageError("prefill") from error
        try:
            launched = None if plan.decode is None else self._launch_decode(plan.decode)
        except Exception as error:
            try:
                done = self._read_prefill(plan, prefilled)
            except Exception:
                raise StageError("read") from error
            raise StageError("decode step", done) from error
        try:
            results = self._read_prefill(plan, prefilled)
            decoded = None if plan.decode is None else self._read_decode(plan.decode, launched)
            # queued prefill work, or the deferred keys' pass, would be in its time
            if decoded is not None and (plan.prefill is not None or self._flushed):
                decoded.seconds = None
            pending = self.slots.pending(plan.read_pending) if plan.read_pending else {}
        except Exception as error:
            raise StageError("read") from error
        return StepResult(results, decoded, pending)

    def _read_prefill(self, plan: StepPlan, prefilled: DevicePrefill | None) -> list:
        return [] if plan.prefill is None or prefilled is None else Prefill.read(plan.prefill, prefilled)

    def _launch_decode(self, batch: DecodeBatch) -> torch.Tensor:
        """The step over slots [0, rows), its output copying to the host (not waited for)."""
        self._launched = time.perf_counter()
        out = self.run_step(batch.rows, batch.kv_len, batch.logits, batch.k)
        if not batch.logprobs:  # the packed log-probabilities stay on the device
            out = out[:, : self.shapes.k + 2]
        host = (self._host_tokens if out.shape[1] == self.shapes.k + 2 else self._host_logprobs)[: batch.rows]
        host.copy_(out, non_blocking=True)
        return host

    def _read_decode(
        self,
        batch: DecodeBatch,
        host: torch.Tensor | None,  # [rows, K + 2 (+ packed logprobs)] on the host
    ) -> DecodeResult:
        assert host is not None
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        seconds = time.perf_counter() - self._launched
        k = self.shapes.k
        rows = host[:, : k + 2].tolist()
        tokens, accepted = [row[: k + 1] for row in rows], [row[k + 1] for row in rows]
        chosen = {}
        for slot, top in batch.logprobs.items():
            packed = host[slot, k + 2 :].view(k + 1, -1)
            chosen[slot] = logprobs.unpack(packed, tokens[slot][: accepted[slot] + 1], top)
        k = self.shapes.k if batch.k is None else batch.k
        return DecodeResult(tokens, accepted, chosen, k, seconds, id(self))

    @torch.inference_mode()
    def log_probs(self, tokens: list[int]) -> torch.Tensor:  # [T - 1, V] fp32, on the CPU
        """Log-probabilities of every next token after each prefix of `tokens` (no cache: `redline eval`'s
        perplexity and KL)."""
        inputs = torch.tensor([tokens[:-1]], device=self.device)
        hidden, _ = self.model(inputs, torch.arange(inputs.shape[1], device=self.device)[None])
        return self.model.logits(hidden)[0].log_softmax(-1).cpu()

    def lost(self) -> str | None:
        """One process: no other rank to lose (ranks.RankGroup reports its workers)."""
        return None

    def close(self) -> None:
        """Nothing to stop on one process."""


def _logits_path_eager(built: Step, eager: Step) -> Step:
    """The compiled or captured step for argmax batches; the eager one for batches on the logits path."""

    def run(rows: int, kv_len: int, any_sampling: bool, k: int) -> torch.Tensor:
        return (eager if any_sampling else built)(rows, kv_len, any_sampling, k)

    return run
