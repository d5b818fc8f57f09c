"""`redline bench`: engines side by side on one model (--model: benchmark/run.py), or a load test of a
running server (--url: load.py, or with --dataset a replay of real traffic: serve_bench.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from redline.benchmark.prompts import ENGINE_SETS
from redline.engine_config import INT4_GROUP_SIZES, WEIGHT_ONLY
from redline.engine_flags import QUANTIZING, add_engine_args

SERVE_FLAGS = ("--num-prompts", "--request-rate", "--max-concurrency", "--max-output-tokens", "--tokenizer")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _lookup(text: str) -> tuple[int, int]:
    sizes = _int_list(text)
    if len(sizes) != 2 or not 1 <= sizes[0] <= sizes[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return sizes[0], sizes[1]


def _tree(text: str) -> tuple[int, int]:
    sizes = _int_list(text)
    if len(sizes) != 2 or sizes[0] < 2 or sizes[1] < 2:
        raise argparse.ArgumentTypeError(f"expected TOPK,NODES with TOPK >= 2 and NODES >= 2, got {text!r}")
    return sizes[0], sizes[1]


def _modes(text: str) -> list[str]:
    return [m for m in text.split(",") if m]


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="HF vs redline vs redline + EAGLE-3 (--model), or load a server (--url)")
    add_engine_args(b, groups=("load", "parallel"), skip=(*QUANTIZING, "device"))
    server = b.add_argument_group("server load test (--url)")
    server.add_argument("--url", help="base URL of an OpenAI-compatible server")
    server.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16], help="client counts")
    server.add_argument("--requests-per-client", type=int, default=2)
    server.add_argument("--api-key")
    server.add_argument("--dataset", choices=["sharegpt"], help="replay held-out conversations")
    server.add_argument("--num-prompts", type=int, help="with --dataset: requests (default 100)")
    help = "with --dataset: Poisson arrivals per s (default inf)"
    server.add_argument("--request-rate", type=float, help=help)
    server.add_argument("--max-concurrency", type=int, help="with --dataset: most in flight")
    server.add_argument("--max-output-tokens", type=int, help="with --dataset: max_tokens cap (default 256)")
    help = "with --dataset: the served model's directory or .gguf"
    server.add_argument("--tokenizer", type=Path, help=help)
    server.add_argument("--ignore-eos", action="store_true", help="with --dataset: exactly max_tokens")
    server.add_argument("--seed", type=int, default=0, help="with --dataset: seed of the arrival times")
    engines = b.add_argument_group("engines (--model)")
    help = "prompts from this held-out set (default: the stdlib held-out files)"
    help += "; humaneval-comments: functions asked back with comments added (repetitive)"
    engines.add_argument("--data", choices=ENGINE_SETS, help=help)
    engines.add_argument("--draft", type=Path, help="an EAGLE-3 draft: redline + EAGLE-3 rows")
    help = "n-gram lookup rows (prompt_lookup_min,max, e.g. 2,4): redline+ngram, and with --draft "
    engines.add_argument("--ngram", type=_lookup, metavar="MIN,MAX", help=help + "redline+eagle3+ngram")
    help = "with --draft, draft tree rows (topk,num_draft_tokens, e.g. 4,8; repeatable): depth K per K"
    engines.add_argument("--tree", type=_tree, action="append", default=[], metavar="TOPK,NODES", help=help)
    engines.add_argument("--num-draft-tokens", type=_int_list, default=[1, 2, 3, 4, 5], help="e.g. 1,2,3")
    engines.add_argument("--max-tokens", type=int, default=128)
    engines.add_argument("--prompts", type=int, default=4)
    engines.add_argument("--prompt-len", type=int, default=64)
    engines.add_argument("--repeats", type=int, default=3)
    help = "redline's modes to run: eager, compiled or eager,compiled"
    engines.add_argument("--modes", type=_modes, default=["compiled"], help=help)
    help = "the same as --modes compiled"
    engines.add_argument("--compile", dest="compiled_mode", action="store_true", help=help)
    engines.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    help = "redline's rows again with weight-only int4 / int8 (quantized on load) or gguf (a .gguf --model's "
    help += "own tensors), e.g. gguf,int4,int8 (CPU)"
    engines.add_argument("--quantization", type=_modes, default=[], help=help)
    help = "with --quantization: weights per group (32 | 64 | 128)"
    engines.add_argument("--quantization-group-size", type=int, default=32, help=help)
    help = "run each engine alone, one after another (one engine's memory at a time; the machine's drift "
    help += "then enters the ratios), not all loaded and taking turns prompt by prompt"
    engines.add_argument("--sequential", action="store_true", help=help)
    help = "with a .gguf --model: skip llama.cpp (run when llama-cpp-python is installed)"
    engines.add_argument("--no-llama-cpp", action="store_true", help=help)
    b.add_argument("--json", type=Path)
    b.add_argument("--plot", type=Path, help="PNG path")
    b.set_defaults(func=run)


def _bench_model(args: argparse.Namespace) -> tuple[Path, tuple[Path, ...]]:
    """The model directory to bench, and the GGUF files llama.cpp runs: with a .gguf model and
    llama-cpp-python installed, the file and an F16 copy of its dequantized weights (cached beside the
    import), and with --quantization int8 a Q8_0 copy of them too."""
    from redline.dtypes import parse_dtype
    from redline.models.source import local_model

    model = Path(args.model)
    model_dir = local_model(model, dtype=parse_dtype(args.dtype))
    if model.suffix != ".gguf":
        return model_dir, ()
    from redline.benchmark import llamacpp
    from redline.models.gguf_copy import write_gguf_copy

    if args.no_llama_cpp or not llamacpp.available():
        return model_dir, ()
    copies = []
    for kind in ("F16", "Q8_0") if "int8" in args.quantization else ("F16",):
        copy = model_dir.parent / f"{kind.lower()}.gguf"
        if not copy.is_file():
            write_gguf_copy(model, copy.with_suffix(".partial"), kind=kind).replace(copy)
        copies.append(copy)
    return model_dir, (model, *copies)


def run(args: argparse.Namespace) -> int:
    from redline.benchmark import report

    if args.url:
        table, result = _bench_dataset(args) if args.dataset else _bench_server(args)
    else:
        table, result = _bench_engines(args)
    print(table)
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot and not args.url:
        report.plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _given(args: argparse.Namespace, flags: tuple[str, ...]) -> bool:
    return any(getattr(args, flag[2:].replace("-", "_")) is not None for flag in flags)


def _bench_engines(args: argparse.Namespace) -> tuple[str, dict]:
    from redline.benchmark import machine, report
    from redline.benchmark.run import BenchSettings, run_bench
    from redline.dtypes import fast_dtype

    if not args.model:
        raise ValueError("redline bench needs --model DIR (engine benchmark) or --url URL (server load test)")
    if args.dataset or _given(args, SERVE_FLAGS):
        raise ValueError(f"--dataset and {', '.join(SERVE_FLAGS)} go with --url; use --data with --model")
    if any(not 1 <= k <= 8 for k in args.num_draft_tokens):
        raise ValueError(f"--num-draft-tokens values must be in 1..8, got {args.num_draft_tokens}")
    if set(args.quantization) - set(WEIGHT_ONLY):
        raise ValueError(
            f"--quantization takes {' and/or '.join(WEIGHT_ONLY)}, got {','.join(args.quantization)}"
        )
    if args.quantization_group_size not in INT4_GROUP_SIZES:
        size = args.quantization_group_size
        raise ValueError(f"--quantization-group-size {size}: one of {INT4_GROUP_SIZES}")
    modes = ["compiled"] if args.compiled_mode else args.modes
    if not modes or set(modes) - {"eager", "compiled"}:
        raise ValueError(f"--modes takes eager and/or compiled, got {','.join(modes)}")
    args.dtype = args.dtype or fast_dtype("cpu")  # bench runs on the CPU
    if args.dtype in ("auto", "fp8"):
        raise ValueError(
            f"redline bench compares engines in one dtype: bfloat16, float16 or float32, not {args.dtype}"
        )
    model_dir, gguf_files = _bench_model(args)
    settings = BenchSettings(
        max_tokens=args.max_tokens, num_prompts=args.prompts, prompt_len=args.prompt_len,
        repeats=args.repeats,
        dtype=args.dtype, modes=tuple(m == "compiled" for m in modes), hf=not args.no_hf, data=args.data,
        gguf_files=gguf_files, tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.enable_expert_parallel, ngram=args.ngram, trees=tuple(args.tree),
        sequential=args.sequential, quantizations=tuple(args.quantization),
        group_size=args.quantization_group_size,
    )  # fmt: skip
    result = {"machine": machine.describe()}
    result |= run_bench(model_dir, args.draft, args.num_draft_tokens, settings)
    return report.table(result), result


def _bench_server(args: argparse.Namespace) -> tuple[str, dict]:
    from redline.benchmark import machine
    from redline.benchmark.load import load_table, run_load

    if _given(args, SERVE_FLAGS):
        raise ValueError(f"{', '.join(SERVE_FLAGS)} replay a data set: add --dataset sharegpt")
    load = run_load(args.url, args.concurrency, args.requests_per_client, args.max_tokens, args.api_key)
    result = {"machine": machine.describe(), **load}
    return load_table(result), result


def _bench_dataset(args: argparse.Namespace) -> tuple[str, dict]:
    from redline.benchmark import machine
    from redline.benchmark.serve_bench import ServeSettings, run_serve_bench
    from redline.benchmark.serve_report import serve_table
    from redline.models.source import local_model

    if args.tokenizer is None:
        raise ValueError(
            "--dataset sharegpt needs --tokenizer DIR (the served model's directory): each request's "
            "max_tokens is its real answer's length in the model's tokens"
        )
    defaulted = {name: getattr(args, name) for name in ("num_prompts", "request_rate", "max_output_tokens")}
    settings = ServeSettings(
        local_model(args.tokenizer),  # a served .gguf file: its import holds the tokenizer
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, seed=args.seed,
        **{name: value for name, value in defaulted.items() if value is not None},  # None: ServeSettings'
    )  # fmt: skip
    result = {"machine": machine.describe(), **run_serve_bench(args.url, settings, args.api_key)}
    return serve_table(result), result
