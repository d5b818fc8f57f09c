"""The user API: LLM(model_dir).generate / stream / chat."""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from redline.config import ModelConfig
from redline.engine.failures import GenerationError
from redline.engine.request import Completion, Request
from redline.engine.scheduler import Scheduler
from redline.models import hub
from redline.parallel import sharding, torchrun, workers
from redline.parallel.group import SINGLE
from redline.parallel.workers import ParallelRunner, RunnerSpec
from redline.sampling import SamplingParams
from redline.tokenizer import Tokenizer

Prompt = str | Sequence[int]

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def checkpoint_dtype(model_dir: Path) -> str:
    """dtype "auto": the checkpoint's own (config.json's torch_dtype, or dtype as transformers 5 writes it),
    bfloat16 when it names none or is not a directory (a .gguf file)."""
    path = model_dir / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    return name if name in DTYPES else "bfloat16"


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}, fp8, auto")
    return DTYPES[name]


def _kv_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name == "fp8":
        return torch.float8_e4m3fn
    return parse_dtype(name)


def _generation_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


class Stream:
    """One request's text piece by piece. If the engine fails the request, iteration raises
    GenerationError after the pieces it produced; `completion` then has finish_reason "error"."""

    def __init__(self, scheduler: Scheduler, request: Request):
        self._scheduler, self._request = scheduler, request

    def __iter__(self) -> Iterator[str]:
        request = self._request
        try:
            while not request.finished:
                for r, piece in self._scheduler.step():
                    if r is request and piece:
                        yield piece
        finally:
            if not request.finished:
                self._scheduler.cancel(request)
        if request.finish_reason == "error":
            raise GenerationError([request.completion()])

    @property
    def completion(self) -> Completion:
        return self._request.completion()


class LLM:
    def __init__(
        self,
        model: str | Path,
        dtype: str | torch.dtype = "bfloat16",
        device: str = "cpu",
        max_batch: int = 8,
        max_seq_len: int | None = None,
        draft: str | Path | None = None,
        num_draft_tokens: int = 3,
        compile: bool | None = None,
        quantization: str | None = None,
        pdl: bool = False,
        kv_cache_dtype: str | None = None,
        progress: bool = True,
        tensor_parallel_size: int = 1,
        expert_parallel: bool = False,
        kv_cache_memory: int | None = None,
        prefix_caching: bool = True,
        max_prefill_tokens: int | None = None,
        gpu_memory_utilization: float = 0.9,
        revision: str | None = None,
    ):
        """model (and draft): a checkpoint directory, a llama .gguf file, or a Hugging Face Hub id such as
        "HuggingFaceTB/SmolLM2-135M-Instruct", fetched into the Hub's cache at `revision` (models/hub.py).
        dtype "fp8" means bfloat16 activations with FP8 weights (quantization="fp8"); pdl launches the
        Triton kernels with programmatic dependent launch (Hopper or newer GPUs); kv_cache_dtype "fp8"
        stores keys and values in e4m3 (scale 1), half the bytes of bf16. compile (default: on CPU, see
        kernels.select.compile_by_default; compile=False runs eager) torch.compiles the decode step and the
        prefill; with it (or on CUDA, where every step shape is captured as a CUDA graph) construction
        compiles and captures every shape the engine can meet, with a progress bar unless progress=False;
        `warmup_s` says how long it took. tensor_parallel_size N > 1 splits the model over N processes
        (parallel/): this one and N - 1 workers it starts, one GPU each on CUDA; close() stops them. With
        expert_parallel each rank holds E / N whole Llama 4 experts instead of a block of every one.
        kv_cache_memory (bytes) sizes the pool of KV blocks (engine/blocks.py) the requests share; by default
        (engine/kv_budget.py) on CUDA gpu_memory_utilization of the device's memory less the weights and a
        prefill's activations, on CPU every slot's whole context up to 4 GiB. When the pool runs dry the
        newest request is preempted (and recomputed later). prefix_caching reuses the KV blocks of prompt
        prefixes computed before (engine/blocks.py). max_prefill_tokens bounds one prefill forward (padding
        included): longer prompts prefill in chunks between decode steps, shorter ones several in one
        forward; None (the default) prefills every prompt whole, batch-1 latency first."""
        model_dir = hub.resolve(model, revision)  # a directory, a .gguf file, or a hub id's snapshot
        draft = None if draft is None else hub.resolve(draft)
        if dtype == "auto":
            dtype = checkpoint_dtype(model_dir)
        if dtype == "fp8":
            dtype, quantization = "bfloat16", "fp8"
        torch_dtype = parse_dtype(dtype)
        if model_dir.suffix == ".gguf":  # imported once into the cache (redline/models/gguf.py)
            from redline.models.gguf import gguf_model_dir, import_dtype

            model_dir = gguf_model_dir(model_dir, import_dtype(torch_dtype), progress=progress)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        self.model_dir = model_dir
        self.config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(
            model_dir, extra_eos_ids=[*self.config.eos_token_ids, *_generation_eos(model_dir)]
        )
        if draft is not None and not 1 <= num_draft_tokens <= 8:
            raise ValueError(f"num_draft_tokens must be in 1..8, got {num_draft_tokens}")
        self.max_seq_len = min(max_seq_len or 4096, self.config.max_position)
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
        if max_prefill_tokens is not None and max_prefill_tokens < 16:
            raise ValueError(f"max_prefill_tokens must be at least 16 (one block), got {max_prefill_tokens}")
        if expert_parallel and tensor_parallel_size == 1:
            raise ValueError("expert_parallel needs tensor_parallel_size > 1")
        spec = RunnerSpec(str(model_dir), torch_dtype, device, max_batch, self.max_seq_len,
                          None if draft is None else str(draft), num_draft_tokens, compile, pdl,
                          _kv_dtype(kv_cache_dtype), quantization, expert_parallel,
                          kv_cache_memory, prefix_caching, gpu_memory_utilization)  # fmt: skip
        if tensor_parallel_size > 1:
            self.runner = self._start_ranks(tensor_parallel_size, spec)
        else:
            self.runner = workers.build_runner(spec, SINGLE)
        self.model, self.draft = self.runner.model, self.runner.draft
        self.num_draft_tokens = num_draft_tokens if self.draft is not None else 0
        self.warmup_s = 0.0  # compiling and capturing every prefill and step shape, before any request
        if self.runner.needs_warm_up:
            start = time.perf_counter()
            self.runner.warm_up(progress=progress)
            self.warmup_s = time.perf_counter() - start
        self.scheduler = Scheduler(self.runner, max_prefill_tokens)

    def _start_ranks(self, size: int, spec: RunnerSpec) -> ParallelRunner:
        """Worker processes for ranks 1 .. size - 1 (parallel/workers.py), or the ranks torchrun started
        (parallel/torchrun.py), stopped by close() or when this LLM is collected."""
        sharding.check_divisible(self.config, size, spec.expert_parallel)  # before any process starts
        runner = torchrun.lead(spec, size) if torchrun.launched() else workers.start(spec, size)
        weakref.finalize(self, runner.close)
        return runner

    def close(self) -> None:
        """Stops the tensor-parallel worker processes (nothing to do on one rank)."""
        if isinstance(self.runner, ParallelRunner):
            self.runner.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Completes each prompt (text or token ids), with one SamplingParams for all or one per prompt;
        continuous batching over `max_batch` slots. A request the engine fails (e.g. out of memory in its
        prefill) fails alone: the others run to the end, then GenerationError is raised with every
        completion in `.completions` (the failed ones with finish_reason "error" and the message)."""
        prompts = self._prompt_list(prompts)
        per_prompt = params if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        requests = [self.make_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        for request in requests:
            self.scheduler.add(request)
        while self.scheduler.has_work:
            self.scheduler.step()
        completions = [r.completion() for r in requests]
        if any(c.finish_reason == "error" for c in completions):
            raise GenerationError(completions)
        return completions

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Stream:
        """Iterate for the completion's text piece by piece; `.completion` holds the result afterwards."""
        request = self.make_request(prompt, params or SamplingParams())
        self.scheduler.add(request)
        return Stream(self.scheduler, request)

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None) -> Completion:
        """Applies the model's chat template and completes the conversation."""
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]

    def _prompt_list(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            return [prompts]  # one prompt
        return list(prompts)

    def make_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        """A validated engine request (not yet scheduled): clear ValueErrors for bad prompts or lengths."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if any(not isinstance(i, int) or not 0 <= i < self.config.vocab_size for i in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.config.vocab_size})")
        if len(ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context window "
                f"of {self.max_seq_len} tokens"
            )
        return Request(
            ids, params, self.tokenizer, self.tokenizer.eos_token_ids, num_draft_tokens=self.num_draft_tokens
        )
