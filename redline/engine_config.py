"""EngineConfig: every option of the engine in one frozen value, validated once.

Options are grouped (what to load, parallelism, KV cache, scheduling, speculation, compilation) and named
as vLLM names them where vLLM has the option; redline's older names are aliases. Every entry point builds
its config from these field definitions: `LLM(model, **options)` through `EngineConfig.create`, and the
command line through `engine_flags.add_engine_args` (the flags are generated from the fields below, so
`redline generate`, `serve`, `bench` and `eval` cannot drift apart).

    EngineConfig.create("DIR", max_num_seqs=8, enable_prefix_caching=False)  # = max_batch, prefix_caching

Values that depend on the model or the machine (dtype "auto" or unset, the context window, where a hub id
lives) are resolved when the engine is built (models/source.py), never here: it reads no file."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

from redline.draft_tree import TreeShape, tree_of
from redline.dtypes import DTYPES, dtype_name, fast_dtype, parse_dtype

MODES = ("min-latency", "max-throughput")
MODE_SLOTS = {"min-latency": 4, "max-throughput": 256}  # max_num_seqs when not given
MAX_THROUGHPUT_PREFILL_TOKENS = 2048  # max-throughput's prefill forwards; min-latency prefills whole prompts
MAX_DRAFT_TOKENS, METHODS = 8, ("eagle3", "ngram")  # the longest draft; speculative methods
NGRAM_MIN, NGRAM_MAX, MAX_NGRAM = 2, 4, 16  # n-gram lookup: default suffix lengths, the longest allowed
DEFAULT_CONTEXT = 4096  # max_model_len when not given: the model's own, at most this
INT4_GROUP_SIZES = (32, 64, 128)  # int4's and int8's (quant/int4.py, kernels/quantized_layout.py)
WEIGHT_ONLY = ("int4", "int8", "gguf")  # on load; gguf: a .gguf file's own tensors (models/gguf_blocks.py)
QUANTIZATIONS = ("fp8", *WEIGHT_ONLY)


def option(default: Any, help: str, *aliases: str, flags: tuple[str, ...] = (), flat: str = "", **kw: Any):
    """A field with what its command-line flag needs. aliases: other Python names accepted for it (and
    their --flags); flags: extra spellings (--tp); flat: its name among all options (default the field's);
    kw: "parse" (str -> value), "choices", "metavar"."""
    metadata = {"help": help, "aliases": aliases, "flags": flags, "flat": flat, **kw}
    return field(default=default, metadata=metadata)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_types(group: Any) -> None:
    """Every field holds its declared type: max_num_seqs=8, not "8" or 1.5 (an int is a float too, a
    bool is no int); TypeError naming the field otherwise."""
    hints = typing.get_type_hints(type(group))
    for f in dataclasses.fields(group):
        value, kinds = getattr(group, f.name), typing.get_args(hints[f.name]) or (hints[f.name],)
        kinds = (*kinds, int) if float in kinds else kinds
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise TypeError(f"{f.name} must be {names}, got {value!r}")


@dataclass(frozen=True)
class LoadConfig:
    model: str = option("", "checkpoint directory, llama .gguf file or Hugging Face Hub id (ORG/NAME)")
    revision: str | None = option(None, "with a hub id: the branch, tag or commit (default main)")
    dtype: str | None = option(None, "bfloat16 | float16 | float32 | fp8 (FP8 weights) | auto (the "
                               "checkpoint's) (default: bfloat16 where the device computes it natively: "
                               "CUDA, CPUs with AVX-512 BF16 or AMX; float32 elsewhere)")  # fmt: skip
    quantization: str | None = option(None, "fp8 | int4 | int8 (weight-only, CPU): quantize the decoder on "
                                      "load; gguf: a .gguf's own tensors", choices=QUANTIZATIONS)  # fmt: skip
    group_size: int = option(32, "int4, int8: weights per group, each with a scale and a zero "
                             "(32 | 64 | 128)", flat="quantization_group_size")  # fmt: skip
    device: str = option("cpu", "cpu | cuda | cuda:N")

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        _check_types(self)
        _require(self.dtype in (*DTYPES, "fp8", "auto", None), f"unknown dtype {self.dtype!r}; choose one of "
                 f"{', '.join(DTYPES)}, fp8, auto")  # fmt: skip
        _require(self.quantization in (None, *QUANTIZATIONS), f"quantization {self.quantization!r}?")
        _require(self.group_size in INT4_GROUP_SIZES, f"quantization_group_size {self.group_size}: 32|64|128")
        gguf_off_cpu = self.quantization == "gguf" and self.device != "cpu"
        _require(self.quantization not in WEIGHT_ONLY or (self.dtype != "fp8" and not gguf_off_cpu),
                 f"{self.quantization} quantization takes high-precision weights (gguf: CPU)")  # fmt: skip
        _require(re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
                 f"unknown device {self.device!r}: cpu | cuda | cuda:N")  # fmt: skip

    @property
    def given_or_fast_dtype(self) -> str:
        """The dtype asked for, or when unset the device's fast one; "auto" stays (the checkpoint's)."""
        return self.dtype or fast_dtype(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activations' dtype (FP8 weights compute in bfloat16); "auto" and unset are resolved with the
        model (models/source.resolve) first."""
        if self.dtype in ("auto", None):
            raise ValueError(f"dtype {self.dtype!r} is resolved when the model is found (models/source.py)")
        return torch.bfloat16 if self.dtype == "fp8" else parse_dtype(self.dtype)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = option(
        1, "split the model over N processes on this machine (one GPU each on CUDA)", flags=("--tp",),
        metavar="N",
    )  # fmt: skip
    enable_expert_parallel: bool = option(
        False, "with --tp N: each rank holds E / N whole Llama 4 experts instead of a block of every one",
        "expert_parallel",
    )  # fmt: skip

    def __post_init__(self) -> None:
        _check_types(self)
        size = self.tensor_parallel_size
        _require(size >= 1, f"tensor_parallel_size must be at least 1, got {size}")
        expert_parallel_ok = not self.enable_expert_parallel or size > 1
        _require(expert_parallel_ok, "expert_parallel needs tensor_parallel_size > 1")


def parse_bytes(text: str) -> int:
    """ "2GiB" -> 2,147,483,648; "512MB" -> 512,000,000; "4096" -> 4,096 (a trailing "b" is optional)."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    number = text.strip().rstrip("bB").rstrip()
    unit = ""
    while number and number[-1].isalpha():
        unit, number = number[-1].lower() + unit, number[:-1]
    factor = units.get(unit[:-1] + "ib" if unit.endswith("i") else unit)
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if factor is None or value < 0:
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 4096, 512MB, 2GiB)")
    return int(value * factor)


@dataclass(frozen=True)
class CacheConfig:
    kv_cache_dtype: str = option("auto", "fp8 | bfloat16 | float16 | float32 | auto (the model's dtype)")
    kv_cache_memory_bytes: int | None = option(
        None, "memory for KV blocks, e.g. 2GiB (default: on CUDA see --gpu-memory-utilization; on CPU every "
        "slot's whole context, at most 4 GiB); the newest request is preempted when they run out",
        "kv_cache_memory", parse=parse_bytes, metavar="BYTES",
    )  # fmt: skip
    gpu_memory_utilization: float = option(
        0.9, "CUDA without --kv-cache-memory: the share of the device's memory for weights, activations "
        "and KV blocks", metavar="FRACTION",
    )  # fmt: skip
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of prompt prefixes computed before", "prefix_caching"
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", kv := dtype_name(self.kv_cache_dtype))
        if isinstance(self.kv_cache_memory_bytes, str):  # LLM(..., kv_cache_memory="2GiB")
            object.__setattr__(self, "kv_cache_memory_bytes", parse_bytes(self.kv_cache_memory_bytes))
        _check_types(self)
        _require(
            kv in (*DTYPES, "fp8", "auto"), f"unknown kv_cache_dtype {kv!r}; choose fp8, auto or a dtype"
        )
        memory = self.kv_cache_memory_bytes
        _require(memory is None or memory > 0, f"kv_cache_memory_bytes must be positive, got {memory}")
        share = self.gpu_memory_utilization
        _require(0 < share <= 1, f"gpu_memory_utilization must be in (0, 1], got {share}")

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return model_dtype
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else parse_dtype(self.kv_cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    mode: str = option(
        "min-latency", "min-latency: 4 slots, whole prompts in one forward; max-throughput: 256 slots (as "
        "the KV pool holds them), prefill in forwards of 2,048 tokens", choices=MODES,
    )  # fmt: skip
    max_num_seqs: int | None = option(
        None, "requests decoding at once (slots; default: the mode's)", "max_batch", metavar="N"
    )
    max_model_len: int | None = option(
        None, f"context window (default: the model's, at most {DEFAULT_CONTEXT})", "max_seq_len", metavar="N"
    )
    max_num_batched_tokens: int | None = option(
        None, "tokens of one prefill forward, padding included: longer prompts prefill in chunks between "
        "decode steps (default: the mode's)", "max_prefill_tokens", metavar="N",
    )  # fmt: skip

    def __post_init__(self) -> None:
        _check_types(self)
        _require(self.mode in MODES, f"unknown mode {self.mode!r}; choose {' or '.join(MODES)}")
        seqs, tokens, length = self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len
        _require(seqs is None or seqs >= 1, f"max_num_seqs must be at least 1, got {seqs}")
        _require(tokens is None or tokens >= 16, f"max_num_batched_tokens must be at least 16 (one block), "
                 f"got {tokens}")  # fmt: skip
        _require(length is None or length >= 2, f"max_model_len must be at least 2, got {length}")

    @property
    def slots(self) -> int:
        return self.max_num_seqs or MODE_SLOTS[self.mode]

    @property
    def prefill_tokens(self) -> int | None:
        """Tokens of one prefill forward; None: whole prompts."""
        if self.max_num_batched_tokens is None and self.mode == "max-throughput":
            return MAX_THROUGHPUT_PREFILL_TOKENS
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}, or
    {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, "num_speculative_tokens": K}
    (proposals copied from the request's own tokens: speculative/ngram.py). With "eagle3", a draft and
    prompt_lookup_max, each slot takes the n-gram proposal where it has a match and the draft's elsewhere."""

    method: str = option(
        "eagle3", "speculative decoding method: eagle3 (a draft model) or ngram (prompt lookup, no model)",
        flat="speculative_method", choices=METHODS,
    )  # fmt: skip
    model: str | None = option(
        None, "EAGLE-3 draft directory or hub id (speculative decoding)", "speculative_model", flat="draft"
    )
    num_speculative_tokens: int = option(3, "draft length K (1..8); a tree's depth", "num_draft_tokens",
                                         "speculative_num_steps", metavar="K")  # fmt: skip
    topk: int = option(
        1, "EAGLE-3 draft trees: children per expanded node (1: a chain)", flat="speculative_eagle_topk"
    )
    num_draft_tokens: int | None = option(None, "EAGLE-3 draft trees: rows verified, the root included "
                                          "(default 2K)", flat="speculative_num_draft_tokens")  # fmt: skip
    prompt_lookup_min: int | None = option(
        None, f"n-gram lookup: the shortest suffix matched (default {NGRAM_MIN}; either alone sets both)",
        metavar="N",
    )  # fmt: skip
    prompt_lookup_max: int | None = option(
        None, f"n-gram lookup: the longest suffix matched (default {NGRAM_MAX} with method ngram; beside an "
        "EAGLE-3 draft, giving it turns lookup on)", metavar="N",
    )  # fmt: skip
    adaptive_draft_length: bool = option(
        True, "steps draft only while the slots' recent acceptance pays for the drafting step's cost; else "
        "they verify no drafts (both kinds of step compiled at start-up)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        _check_types(self)
        self.tree  # noqa: B018 (draft_tree.tree_of checks the tree's options)
        _require(self.method in METHODS, f'unknown speculative method {self.method!r}; choose "eagle3" or '
                 '"ngram"')  # fmt: skip
        k = self.num_speculative_tokens
        _require(
            1 <= k <= MAX_DRAFT_TOKENS,
            f"num_speculative_tokens must be an integer in 1..{MAX_DRAFT_TOKENS}, got {k!r}",
        )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            _require(n is None or 1 <= n <= MAX_NGRAM, f"{name} must be in 1..{MAX_NGRAM}, got {n}")
        _require(low is None or high is None or low <= high,
                 f"prompt_lookup_min {low} is more than prompt_lookup_max {high}")  # fmt: skip
        if self.method == "ngram":
            _require(self.model is None, 'method "ngram" takes no draft model; for n-gram lookup beside an '
                     'EAGLE-3 draft give method "eagle3" with prompt_lookup_max')  # fmt: skip
        elif (low, high) != (None, None):
            _require(self.model is not None, 'prompt lookup needs method "ngram", or a draft model to sit '
                     "beside")  # fmt: skip
            _require(high is not None, "prompt_lookup_min beside an EAGLE-3 draft needs prompt_lookup_max "
                     '(or method "ngram")')  # fmt: skip

    @property
    def tree(self) -> TreeShape | None:
        """The draft tree's shape where topk > 1: depth K, num_draft_tokens rows (default 2K)."""
        with_draft = self.method == "eagle3"
        return tree_of(self.topk, self.num_speculative_tokens, self.num_draft_tokens, with_draft)

    @property
    def lookup(self) -> tuple[int, int] | None:
        """The n-gram suffix lengths (min, max) when lookup is on: method ngram, or eagle3 with a draft
        and prompt_lookup_max. As in vLLM one given alone sets both; neither: NGRAM_MIN, NGRAM_MAX (vLLM's
        are 5 and 5)."""
        if self.method == "eagle3" and (self.model is None or self.prompt_lookup_max is None):
            return None
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return NGRAM_MIN, NGRAM_MAX
        return low or high, high or low

    @property
    def on(self) -> bool:
        """Whether the engine speculates: a draft model, or n-gram lookup."""
        return self.model is not None or self.method == "ngram"

    @classmethod
    def from_json(cls, text: str | dict) -> SpeculativeConfig:
        """'{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}' (or the dict)."""
        try:
            raw = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {raw!r}")
        if raw.get("method", "eagle3") == "eagle3" and not isinstance(raw.get("model"), str):
            raise ValueError(f'speculative_config needs "model": the draft directory or hub id, got {raw!r}')
        known = {f.name for f in dataclasses.fields(cls)}
        _require(set(raw) <= known, f"speculative_config: unknown keys {sorted(set(raw) - known)}")
        try:
            return cls(**raw)
        except TypeError as e:  # a wrong type in the user's JSON: a configuration error like the others
            raise ValueError(f"speculative_config: {e}") from e


@dataclass(frozen=True)
class CompileConfig:
    compile: bool | None = option(
        None,
        "torch.compile the decode step and the prefill, every shape at start-up (default: on CPU, "
        "unless REDLINE_COMPILE=0; CUDA captures CUDA graphs instead)",
    )
    cuda_graphs: bool | None = option(
        None, "capture every decode step shape as a CUDA graph (default: on CUDA)"
    )
    pdl: bool = option(False, "programmatic dependent launch of the Triton kernels (Hopper or newer GPUs)")
    compile_sampling: bool = option(True, "compile (CUDA: capture) the logits path's steps too; off: eager")
    compile_in_background: bool | None = option(
        None,
        "serve eagerly from the first request while the compiled graphs build in a background thread, then "
        "switch (default: on for `redline generate` and `serve` when compile is left to its CPU default on "
        "one process; off for LLM(), which compiles every shape before the first request)",
    )

    def __post_init__(self) -> None:
        _check_types(self)


GROUPS = {
    "load": LoadConfig,
    "parallel": ParallelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "compilation": CompileConfig,
}


@dataclass(frozen=True)
class Option:
    """One option as the entry points see it: its group and field, its names, its flag's needs."""

    group: str
    field: dataclasses.Field
    flat: str  # the name among every option (LLM's keyword, argparse's dest)
    aliases: tuple[str, ...]

    @property
    def default(self) -> Any:
        return self.field.default


def options() -> dict[str, Option]:
    """Every option by its flat name, in group order."""
    out = {}
    for group, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            flat = f.metadata["flat"] or f.name
            out[flat] = Option(group, f, flat, f.metadata["aliases"])
    return out


@dataclass(frozen=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    compilation: CompileConfig = field(default_factory=CompileConfig)

    def __post_init__(self) -> None:
        _require(bool(self.load.model), "no model given: a checkpoint directory, a .gguf file or a hub id")
        on_cpu, compilation = self.load.device == "cpu", self.compilation
        _require(not (on_cpu and compilation.cuda_graphs), "cuda_graphs needs a CUDA device (device cuda)")
        _require(not (on_cpu and compilation.pdl), "pdl needs a CUDA device (Hopper or newer)")
        if compilation.compile_in_background:
            one = "compile_in_background runs on one process (tensor_parallel_size 1)"
            _require(self.parallel.tensor_parallel_size == 1, one)
            _require(compilation.compile is not False, "compile_in_background needs compile")
            cpu = "compile_in_background is for CPU compile (CUDA captures CUDA graphs at start-up)"
            _require(on_cpu, cpu)

    @classmethod
    def create(cls, model: str | Any = "", **given: Any) -> EngineConfig:
        """From flat options (vLLM's names or redline's aliases): create("DIR", max_num_seqs=4, draft="D").
        speculative_config (vLLM's JSON or dict) sets the speculative group at once."""
        by_name = {name: o for o in options().values() for name in (o.flat, *o.aliases)}
        values: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
        spec = given.pop("speculative_config", None)
        if spec is not None:
            values["speculative"] = dataclasses.asdict(SpeculativeConfig.from_json(spec))
        for name, value in given.items():
            if name not in by_name:
                known = ", ".join(sorted(o.flat for o in options().values()))
                raise TypeError(f"unknown engine option {name!r}; the options are: {known}")
            o = by_name[name]
            if o.group == "speculative" and spec is not None:
                raise ValueError(f"give the draft once: {name} or speculative_config")
            if o.field.name in values[o.group]:
                raise ValueError(f"{name} given twice (as {o.flat} and an alias)")
            values[o.group][o.field.name] = value
        values["load"]["model"] = str(values["load"].get("model") or model)
        draft = values["speculative"].get("model")
        if draft is not None:
            values["speculative"]["model"] = str(draft)  # a Path, say
        return cls(**{group: GROUPS[group](**fields) for group, fields in values.items()})

    def replace(self, **given: Any) -> EngineConfig:
        """A copy with some flat options changed: config.replace(max_num_seqs=1)."""
        by_name = {name: o for o in options().values() for name in (o.flat, *o.aliases)}
        groups: dict[str, dict[str, Any]] = {}
        for name, value in given.items():
            if name not in by_name:
                raise TypeError(f"unknown engine option {name!r}")
            o = by_name[name]
            groups.setdefault(o.group, {})[o.field.name] = value
        changed = {g: dataclasses.replace(getattr(self, g), **fields) for g, fields in groups.items()}
        return dataclasses.replace(self, **changed)

    @property
    def speculation(self) -> bool:
        return self.speculative.on

    def compiles_in_background(self, compiles: bool) -> bool:
        """Whether the engine serves eagerly while compiling (compiles: whether it compiles at all)."""
        return bool(self.compilation.compile_in_background) and compiles

    def answering_at_once(self) -> EngineConfig:
        """For a process that runs one engine (`redline generate`, `serve`): compile_in_background where the
        engine compiles by its CPU default on one process and the option was not given. Not LLM()'s
        default: dynamo's stance and config are process-wide, so a compile in the background could
        change how another engine of the process runs its graphs."""
        c = self.compilation
        alone = self.parallel.tensor_parallel_size == 1 and self.load.device == "cpu"
        if c.compile_in_background is not None or c.compile is not None or not alone:
            return self
        return self.replace(compile_in_background=True)

    @property
    def num_draft_tokens(self) -> int:
        """K: draft tokens verified per step (0 without speculation)."""
        return self.speculative.num_speculative_tokens if self.speculation else 0
