"""The user API: LLM(model, **options).generate / stream / chat.

    llm = LLM("path/to/Llama-3.1-8B-Instruct", dtype="bfloat16", device="cuda", max_num_seqs=8)

The options are EngineConfig's (engine_config.py: vLLM's names, or redline's older ones), or a whole
`config=EngineConfig(...)`. Building an LLM resolves where the model comes from (models/source.py), loads
it on every tensor-parallel rank (runner/build.py, runner/ranks.py), compiles and captures every shape
(runner/warm_up.py), and starts the engine core (engine/core.py), which generate, stream and a server's
engine loop drive.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from redline.config import ModelConfig
from redline.engine.core import EngineCore, EngineStats
from redline.engine.request import Completion, GenerationError, Request
from redline.engine.scheduler import Scheduler
from redline.engine_config import EngineConfig
from redline.models import source
from redline.parallel import sharding
from redline.runner import ranks, torchrun
from redline.runner.background_compile import BackgroundCompile
from redline.runner.build import build_single, context_len, shapes_of
from redline.runner.model_runner import ModelRunner
from redline.runner.warm_up import needs_warm_up, warm_up
from redline.sampling import ParamError, SamplingParams
from redline.structured.grammar import GrammarCompiler, StructuredError
from redline.structured.matcher import RequestGrammar
from redline.structured.rules import TokenRules
from redline.structured.token_controls import BadWords, TokenBias, bad_word_ids, token_bias
from redline.tokenizer import Tokenizer
from redline.tool_calls.formats import ToolFormat, format_for, template_format
from redline.tool_calls.tool_use import ToolUse, template_messages

Prompt = str | Sequence[int]


def _generation_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


class Stream:
    """One request's text piece by piece. If the engine fails the request, iteration raises
    GenerationError after the pieces it produced; `completion` then has finish_reason "error"."""

    def __init__(self, engine: EngineCore, request: Request):
        self._engine, self._request = engine, request

    def __iter__(self) -> Iterator[str]:
        request = self._request
        with self._engine.driving():  # no other thread steps the engine while this stream iterates
            try:
                while not request.finished:
                    for r, piece in self._engine.step():
                        if r is request and piece:
                            yield piece
            finally:
                if not request.finished:
                    self._engine.cancel(request)
        if request.finish_reason == "error":
            raise GenerationError([request.completion()])

    @property
    def completion(self) -> Completion:
        return self._request.completion()


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        config: EngineConfig | None = None,
        progress: bool = True,
        **options: Any,
    ):
        """model: a checkpoint directory, a llama .gguf file, or a Hugging Face Hub id such as
        "HuggingFaceTB/SmolLM2-135M-Instruct" (fetched into the Hub's cache at `revision`); options:
        EngineConfig's (README "Engine options"), or config= a whole EngineConfig. With compile (the
        default on CPU) or on CUDA (where every step shape is captured as a CUDA graph), construction
        compiles and captures every shape the engine can meet, with a progress bar unless progress=False;
        `warmup_s` says how long it took. With compile_in_background it answers at once on an eager runner
        and switches to the compiled graphs when they are built (wait_compiled()). With
        tensor_parallel_size N > 1 this process is rank 0 of N (one GPU each on CUDA); close() stops the
        others."""
        if config is None:
            config = EngineConfig.create(model or "", **options)
        elif model is not None or options:
            raise TypeError("LLM takes a config or a model with options, not both")
        self.config = config = source.resolve(config, progress)
        self.model_dir = Path(config.load.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        eos = [*self.model_config.eos_token_ids, *_generation_eos(self.model_dir)]
        self.tokenizer = Tokenizer.from_dir(self.model_dir, extra_eos_ids=eos)
        self.max_seq_len = context_len(config, self.model_config)
        self.num_draft_tokens = config.num_draft_tokens
        size = config.parallel.tensor_parallel_size
        if size > 1:
            sharding.check_divisible(self.model_config, size, config.parallel.enable_expert_parallel)
            self.executor: ModelRunner | ranks.RankGroup | BackgroundCompile = (
                torchrun.lead(config, size) if torchrun.launched() else ranks.start(config, size)
            )
            weakref.finalize(self, self.executor.close)
        else:
            self.executor = build_single(config, progress)
            if isinstance(self.executor, BackgroundCompile):  # at exit, the compile thread stops first
                weakref.finalize(self, self.executor.close)
        self.warmup_s = 0.0  # compiling and capturing every prefill and step shape, before any request
        if not isinstance(self.executor, BackgroundCompile) and needs_warm_up(self.runner):
            start = time.perf_counter()
            if isinstance(self.executor, ranks.RankGroup):
                self.executor.warm_up(progress)
            else:
                warm_up(self.executor, progress)
            self.warmup_s = time.perf_counter() - start
        shapes = shapes_of(config, self.model_config)
        self._grammars: GrammarCompiler | None = None  # built at the first structured request
        self._grammars_lock = threading.Lock()  # the server makes requests on its HTTP thread
        draft = config.speculative.model is not None  # a cached block's key covers the next token too
        scheduler = Scheduler(shapes, self.executor.num_blocks, config.scheduler.prefill_tokens,
                              config.cache.enable_prefix_caching, draft)  # fmt: skip
        self.engine = EngineCore(scheduler, self.executor)

    @property
    def runner(self) -> ModelRunner:
        """This process's runner (rank 0's under tensor parallelism; the one serving now while compiling in
        the background): the device side, for benchmarks."""
        if isinstance(self.executor, ranks.RankGroup | BackgroundCompile):
            return self.executor.runner
        return self.executor

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """With compile_in_background: blocks until the compiled graphs are ready (True; the next step runs
        them) or `timeout` seconds pass (False). True at once for an engine that compiled at start-up."""
        return self.executor.wait(timeout) if isinstance(self.executor, BackgroundCompile) else True

    @property
    def model(self) -> torch.nn.Module:
        """The target model (this rank's shard)."""
        return self.runner.model

    @property
    def draft(self) -> torch.nn.Module | None:
        return self.runner.draft

    def close(self) -> None:
        """Stops the tensor-parallel worker processes, or a compile in the background."""
        self.executor.close()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Completes each prompt (text or token ids), with one SamplingParams for all or one per prompt;
        continuous batching over max_num_seqs slots. A request the engine fails (e.g. out of memory in its
        prefill) fails alone: the others run to the end, then GenerationError is raised with every
        completion in `.completions` (the failed ones with finish_reason "error" and the message)."""
        prompts = self._prompt_list(prompts)
        per_prompt = params if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        requests = [self.make_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        with self.engine.driving():  # one thread at a time: another's generate waits for none, it raises
            for request in requests:
                self.engine.add(request)
            while self.engine.has_work:
                self.engine.step()
        completions = [r.completion() for r in requests]
        if any(c.finish_reason == "error" for c in completions):
            raise GenerationError(completions)
        return completions

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Stream:
        """Iterate for the completion's text piece by piece; `.completion` holds the result afterwards."""
        request = self.make_request(prompt, params or SamplingParams())
        self.engine.add(request)
        return Stream(self.engine, request)

    @cached_property
    def _template_tool_format(self) -> ToolFormat | None:
        """The tool-call format the chat template writes (rendered once)."""
        return template_format(self.tokenizer)

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        tools: Sequence[dict] | None = None,
        tool_choice: str = "auto",
        parallel_tool_calls: bool = True,
        tool_call_parser: str | None = None,
    ) -> Completion:
        """Applies the model's chat template and completes the conversation. With tools (OpenAI's function
        objects, or {"type": "function", "function": ...}) the template renders them, tool_choice is
        "auto", "required" or a tool's name (tool_calls/tool_use.py), and an output that is calls comes
        back in `tool_calls` (finish_reason "tool_calls", text ""). tool_call_parser: "llama3_json" or
        "pythonic" (None: the one the chat template writes, else the family's: tool_calls/formats.py)."""
        params = params or SamplingParams()
        if not tools or tool_choice == "none":
            return self.generate([self.tokenizer.encode_chat(template_messages(messages))], params)[0]
        functions = tuple(tool.get("function", tool) for tool in tools)
        writes = format_for(self.model_config.family, tool_call_parser, self._template_tool_format)
        use = ToolUse(functions, tool_choice, parallel_tool_calls, writes)
        if (calls := use.constraint()) is not None:
            if params.structured is not None:
                raise ValueError(f"tool_choice {tool_choice!r} holds the output to a call: drop `structured`")
            params = dataclasses.replace(params, structured=calls)
        ids = self.tokenizer.encode_chat(template_messages(messages), tools=use.template_tools)
        completion = self.generate([ids], params)[0]
        content, calls, completion.finish_reason = use.read(completion.text, completion.finish_reason)
        completion.text, completion.tool_calls = content or "", calls or None
        return completion

    def log_probs(self, tokens: list[int]) -> torch.Tensor:  # [T - 1, V] fp32, on the CPU
        """Log-probabilities of every next token after each prefix of `tokens`, by a whole forward without
        a cache (on every tensor-parallel rank): `redline eval`'s perplexity and KL, tests' references."""
        return self.executor.log_probs(tokens)

    def _token_rules(self, params: SamplingParams, vocab: int) -> tuple[TokenRules | None, TokenBias | None]:
        """The request's row rules (a grammar, bad words of several tokens) and bias row (logit_bias,
        allowed_token_ids, bad words of one token): StructuredError (a ValueError) for a spec that does not
        compile or allows no text, ValueError for token ids past the vocabulary."""
        for name in ("logit_bias", "allowed_token_ids"):
            if any(t >= vocab for t in getattr(params, name) or ()):
                raise ParamError(name, f"token ids must be in [0, {vocab})")
        grammar = None
        if params.structured is not None:
            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = GrammarCompiler(self.tokenizer, vocab, self.tokenizer.eos_token_ids)
            grammar = RequestGrammar(self._grammars.compile(params.structured), vocab)
            if not grammar.next_mask().any():  # the regex [^\s\S] compiles, to a grammar that allows none
                raise StructuredError("the structured output allows no text at all (its language is empty)")
        sequences = bad_word_ids(self.tokenizer, params.bad_words or [])
        bad_words = BadWords(sequences)
        rules = TokenRules(vocab, grammar, bad_words) if grammar is not None or bad_words else None
        banned = {ids[0] for ids in sequences if len(ids) == 1}
        return rules, token_bias(params, banned)

    def _prompt_list(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            return [prompts]  # one prompt
        return list(prompts)

    def make_request(self, prompt: Prompt, params: SamplingParams, group: object = None) -> Request:
        """A validated engine request (not yet scheduled): clear ValueErrors for bad prompts or lengths.
        group: any object the n samples of one prompt share (they share its prefill, engine/scheduler.py)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(i, int) or not 0 <= i < vocab for i in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context window "
                f"of {self.max_seq_len} tokens"
            )
        rules, bias = self._token_rules(params, vocab)
        return Request(ids, params, self.tokenizer, self.tokenizer.eos_token_ids, rules=rules, bias=bias,
                       num_draft_tokens=self.num_draft_tokens, group=group)  # fmt: skip
