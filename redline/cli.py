"""Command line: `redline generate | info | init-random | train-target | train-draft | demo | bench |
import-gguf | quantize | eval | serve`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from redline.config import ModelConfig


def _add_model_args(p: argparse.ArgumentParser) -> None:
    help = "checkpoint directory, llama .gguf file or Hugging Face Hub id (ORG/NAME)"
    p.add_argument("--model", required=True, type=Path, help=help)
    p.add_argument("--revision", default=None, help="with a hub id: the branch, tag or commit (default main)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32 | fp8 (FP8 weights)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    add_tensor_parallel_arg(p)


def add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    help = "split the model over N processes on this machine (one GPU each on CUDA)"
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="N", help=help)
    help = "with --tp N: each rank holds E / N whole Llama 4 experts instead of a block of every one"
    p.add_argument("--expert-parallel", action="store_true", help=help)


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """ "2GiB" -> 2,147,483,648; "512MB" -> 512,000,000; "4096" -> 4,096 (a trailing "b" is optional)."""
    number = text.strip().rstrip("bB").rstrip()
    unit = ""
    while number and number[-1].isalpha():
        unit, number = number[-1].lower() + unit, number[:-1]
    factor = _UNITS.get(unit[:-1] + "ib" if unit.endswith("i") else unit)
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if factor is None or value < 0:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4096, 512MB, 2GiB)")
    return int(value * factor)


def add_kv_args(p: argparse.ArgumentParser, max_prefill_default: str = "whole prompts") -> None:
    """The KV cache and prefill flags of generate and serve."""
    help = "memory for KV blocks, e.g. 2GiB (default: on CUDA see --gpu-memory-utilization; on CPU every "
    help += "slot's whole context, at most 4 GiB); the newest request is preempted when they run out"
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES", help=help)
    help = "CUDA without --kv-cache-memory: the share of the device's memory for weights, activations and "
    help += "KV blocks (default 0.9)"
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION", help=help)
    help = "do not reuse the KV blocks of prompt prefixes computed before (vLLM: --no-enable-prefix-caching)"
    no = ("--no-prefix-caching", "--no-enable-prefix-caching")
    p.add_argument(*no, dest="prefix_caching", action="store_false", help=help)
    p.add_argument(
        "--enable-prefix-caching",
        dest="prefix_caching",
        action="store_true",
        default=True,
        help="the default",
    )
    help = "tokens of one prefill forward (longer prompts prefill in chunks between decode steps; "
    help += f"default: {max_prefill_default}); vLLM's --max-num-batched-tokens"
    p.add_argument(
        "--max-prefill-tokens", "--max-num-batched-tokens", type=int, default=None, metavar="N", help=help
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from redline import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(
        args.model,
        revision=args.revision,
        dtype=args.dtype,
        device=args.device,
        draft=args.draft,
        num_draft_tokens=args.num_draft_tokens,
        compile=args.compile,
        pdl=args.pdl,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefix_caching=args.prefix_caching,
        max_prefill_tokens=args.max_prefill_tokens,
        max_batch=1,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
    )
    if llm.warmup_s:
        print(
            f"[redline] warm-up (compiling every prefill and step shape): {llm.warmup_s:.1f} s",
            file=sys.stderr,
        )
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.chat}]) if args.chat else args.prompt
    stream = llm.stream(prompt, params)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    request = stream.completion
    print()
    summary = (
        f"[redline] prompt tokens: {request.prompt_tokens} | generated tokens: {request.completion_tokens} "
        f"| finish: {request.finish_reason} | time to first token: {request.ttft_s * 1000:.1f} ms "
        f"| {request.tokens_per_s:.1f} tokens/s per user"
    )
    if request.acceptance_length is not None:
        rates = ", ".join(f"{r:.2f}" for r in request.acceptance_rates or [])
        summary += f" | acceptance length: {request.acceptance_length:.2f} (per position: {rates})"
    print(summary, file=sys.stderr)
    return 0


def checkpoint_dir(path: Path, revision: str | None = None) -> Path:
    """A checkpoint directory as it is; a hub id: its snapshot at `revision`; a .gguf file: its bf16 import
    (made once, cached)."""
    from redline.models import hub

    path = hub.resolve(path, revision)
    if path.suffix != ".gguf":
        return path
    import torch

    from redline.models.gguf import gguf_model_dir

    return gguf_model_dir(path, torch.bfloat16)


def cmd_info(args: argparse.Namespace) -> int:
    model_dir = checkpoint_dir(args.model, args.revision)
    c = ModelConfig.from_dir(model_dir)
    print(f"architecture: {c.architecture} ({c.family})")
    print(f"parameters: ~{c.num_params_estimate / 1e6:.1f}M")
    print(
        f"vocab: {c.vocab_size} | hidden: {c.hidden_size} | layers: {c.num_layers} | heads: {c.num_heads} "
        f"(kv {c.num_kv_heads}, head_dim {c.head_dim}) | mlp: {c.intermediate_size}"
    )
    print(
        f"rope: theta {c.rope.theta:g}, scaling {c.rope.scaling}"
        + (f" (factor {c.rope.factor:g})" if c.rope.scaling == "llama3" else "")
    )
    print(f"max positions: {c.max_position} | tied embeddings: {c.tie_word_embeddings}")
    if c.family == "llama4":
        print(
            f"experts: {c.num_experts} (top-{c.num_experts_per_tok}, width {c.expert_intermediate_size}) "
            f"| chunk: {c.attention_chunk_size} | qk-norm: {c.use_qk_norm} "
            f"| temperature tuning: {c.attn_temperature_tuning}"
        )
    pattern = []
    for i in range(c.num_layers):
        attn = ("chunked" if c.is_chunked_layer(i) else "rope") if c.is_rope_layer(i) else "nope"
        pattern.append(f"{attn}+{'moe' if i in c.moe_layers else 'dense'}")
    print("layers: " + " ".join(f"{i}:{p}" for i, p in enumerate(pattern)))
    if args.tensor_parallel_size > 1:
        print(_per_rank(model_dir, args.tensor_parallel_size, args.expert_parallel))
    return 0


def _per_rank(model_dir: Path, size: int, expert_parallel: bool) -> str:
    """What each of `size` tensor-parallel ranks holds (every rank's shard has the same shapes), and its
    bytes as loaded: FP8 weights 1 byte, their fp32 scales 4, everything else bf16."""
    import torch

    from redline.models.build import skeleton
    from redline.parallel.group import TensorParallel

    model = skeleton(model_dir, TensorParallel(0, size, expert_parallel=expert_parallel))
    model.tie_weights()
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    loaded = sum(p.numel() * (1 if p.dtype == torch.float8_e4m3fn else 4 if "scale" in n else 2)
                 for n, p in model.named_parameters())  # fmt: skip
    return (
        f"tensor parallel {size}: {count:,} parameters per rank, {loaded:,} bytes each as loaded "
        f"({loaded / 2**30:.2f} GiB)"
    )


def cmd_init_random(args: argparse.Namespace) -> int:
    from redline.models.random_init import write_random_model

    out = write_random_model(args.out, vocab_size=args.vocab_size, seed=args.seed)
    print(f"wrote a random tiny Llama checkpoint to {out}")
    return 0


def _add_recipe_args(p: argparse.ArgumentParser, recipe: type) -> None:
    """One flag per recipe field, defaulting to the recipe's value: DraftRecipe.ttt_steps -> --ttt-steps."""
    hints = typing.get_type_hints(recipe)
    for field in dataclasses.fields(recipe):
        kind = hints[field.name]
        convert = int if kind in (int, int | None) else float if kind is float else str
        flag = "--" + field.name.replace("_", "-")
        p.add_argument(
            flag, dest=field.name, type=convert, default=field.default, help=f"default {field.default}"
        )


def _recipe(recipe: type, args: argparse.Namespace):
    return recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(recipe)})


def cmd_train_target(args: argparse.Namespace) -> int:
    from redline.train.target import TargetRecipe, train_target

    summary = train_target(args.out, _recipe(TargetRecipe, args), resume=args.resume)
    print(
        f"wrote {args.out}: {summary['parameters'] / 1e6:.1f}M parameters, held-out loss "
        f"{summary['held_out_loss']:.3f} (perplexity {summary['held_out_perplexity']:.1f})"
    )
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    from redline.data.sources import resolve
    from redline.train.draft import DraftRecipe, train_draft

    data = resolve(args.data, training=True) if args.data else None
    summary = train_draft(
        checkpoint_dir(args.target), args.out, _recipe(DraftRecipe, args), data, resume=args.resume,
        budget_minutes=args.budget_minutes,
    )  # fmt: skip
    accuracy = ", ".join(f"{summary[k]:.2f}" for k in summary if k.startswith("acc"))
    print(
        f"wrote {args.out}: {summary['sequences']} answers, {summary['steps_done']} steps, final TTT loss "
        f"{summary['final_loss']:.3f}, top-1 agreement per step: {accuracy}"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from redline.demo import DEMO_K, run_demo

    run_demo(args.prompts, args.max_tokens, args.num_draft_tokens or DEMO_K, args.compile, args.dtype)
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _bench_model(args: argparse.Namespace) -> tuple[Path, tuple[Path, ...]]:
    """The model directory to bench, and the GGUF files llama.cpp runs: with a .gguf model and
    llama-cpp-python installed, the file and an F16 copy of its dequantized weights (cached beside the
    import)."""
    if args.model.suffix != ".gguf":
        return args.model, ()
    from redline.benchmark import llamacpp
    from redline.engine.llm import parse_dtype
    from redline.models.gguf import gguf_model_dir, import_dtype
    from redline.models.gguf_f16 import write_f16_gguf

    model_dir = gguf_model_dir(args.model, import_dtype(parse_dtype(args.dtype)))
    if args.no_llama_cpp or not llamacpp.available():
        return model_dir, ()
    f16 = model_dir.parent / "f16.gguf"
    if not f16.is_file():
        write_f16_gguf(args.model, f16.with_suffix(".partial")).replace(f16)
    return model_dir, (args.model, f16)


def cmd_bench(args: argparse.Namespace) -> int:
    from redline.benchmark import machine, report
    from redline.benchmark.run import BenchSettings, run_bench

    if args.url:
        return _bench_server(args)
    if args.model is None:
        raise ValueError("redline bench needs --model DIR (engine benchmark) or --url URL (server load test)")
    if args.dataset or _given(args, SERVE_FLAGS):
        raise ValueError(f"--dataset and {', '.join(SERVE_FLAGS)} go with --url; use --data with --model")
    if any(not 1 <= k <= 8 for k in args.num_draft_tokens):
        raise ValueError(f"--num-draft-tokens values must be in 1..8, got {args.num_draft_tokens}")
    modes = ["compiled"] if args.compile else args.modes
    if not modes or set(modes) - {"eager", "compiled"}:
        raise ValueError(f"--modes takes eager and/or compiled, got {','.join(modes)}")
    model_dir, gguf_files = _bench_model(args)
    settings = BenchSettings(
        max_tokens=args.max_tokens,
        num_prompts=args.prompts,
        prompt_len=args.prompt_len,
        repeats=args.repeats,
        dtype=args.dtype,
        modes=tuple(m == "compiled" for m in modes),
        hf=not args.no_hf,
        data=args.data,
        gguf_files=gguf_files,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
    )
    result = {
        "machine": machine.describe(),
        **run_bench(model_dir, args.draft, args.num_draft_tokens, settings),
    }
    print(report.table(result))
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


SERVE_FLAGS = ("--num-prompts", "--request-rate", "--max-concurrency", "--max-output-tokens", "--tokenizer")


def _given(args: argparse.Namespace, flags: tuple[str, ...]) -> bool:
    return any(getattr(args, flag[2:].replace("-", "_")) is not None for flag in flags)


def _bench_server(args: argparse.Namespace) -> int:
    from redline.benchmark import machine
    from redline.benchmark.load import load_table, run_load

    if args.dataset:
        return _bench_dataset(args)
    if _given(args, SERVE_FLAGS):
        raise ValueError(f"{', '.join(SERVE_FLAGS)} replay a data set: add --dataset sharegpt")
    result = {"machine": machine.describe(), **run_load(args.url, args.concurrency, args.requests_per_client,
                                                        args.max_tokens, args.api_key)}  # fmt: skip
    return _show(load_table(result), result, args.json)


def _show(table: str, result: dict, json_path: Path | None) -> int:
    from redline.benchmark import report

    print(table)
    if json_path:
        report.write_json(result, json_path)
        print(f"wrote {json_path}")
    return 0


def _bench_dataset(args: argparse.Namespace) -> int:
    import math

    from redline.benchmark import machine
    from redline.benchmark.serve_bench import ServeSettings, run_serve_bench
    from redline.benchmark.serve_report import serve_table

    if args.tokenizer is None:
        raise ValueError(
            "--dataset sharegpt needs --tokenizer DIR (the served model's directory): each request's "
            "max_tokens is its real answer's length in the model's tokens"
        )
    tokenizer = args.tokenizer
    if tokenizer.suffix == ".gguf":  # the served file: its import holds the tokenizer
        from redline.models.gguf import gguf_model_dir

        tokenizer = gguf_model_dir(tokenizer)
    settings = ServeSettings(
        tokenizer,
        num_prompts=100 if args.num_prompts is None else args.num_prompts,
        request_rate=math.inf if args.request_rate is None else args.request_rate,
        max_concurrency=args.max_concurrency,
        max_output_tokens=256 if args.max_output_tokens is None else args.max_output_tokens,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )
    result = {"machine": machine.describe(), **run_serve_bench(args.url, settings, args.api_key)}
    return _show(serve_table(result), result, args.json)


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from redline.engine.llm import parse_dtype
    from redline.models.gguf import import_gguf
    from redline.models.shards import DEFAULT_SHARD_BYTES

    if args.out.exists() and any(args.out.iterdir()):
        raise ValueError(f"{args.out} is not empty: import into a new directory")
    shard_bytes = DEFAULT_SHARD_BYTES if args.max_shard_gb is None else int(args.max_shard_gb * 10**9)
    import_gguf(args.gguf, args.out, parse_dtype(args.dtype), max_shard_bytes=shard_bytes)
    files = sorted(p.name for p in args.out.iterdir())
    print(f"wrote {args.out}: {', '.join(files)}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from redline.quant.checkpoint import quantize_checkpoint

    counts = quantize_checkpoint(args.model, args.out, max_shard_bytes=int(args.max_shard_gb * 10**9))
    fp8, total = counts["fp8_parameters"], counts["parameters"]
    print(f"wrote {args.out}: {fp8:,} of {total:,} parameters in FP8 ({fp8 / total:.0%})")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from redline.data.sources import resolve
    from redline.evaluate import public_sets
    from redline.evaluate.run import EvalConfig, eval_table, evaluate, parse_config
    from redline.evaluate.tasks import load_tasks
    from redline.train import data

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    configs = [EvalConfig(args.dtype, args.model, args.dtype)]
    configs += [parse_config(spec, configs[0]) for spec in args.compare]
    source = resolve(args.data)
    if isinstance(source, str):  # a built-in set: its own held-out text for perplexity
        tasks, texts = public_sets.tasks(source), public_sets.texts(source)
    else:
        tasks, texts = load_tasks(source), data.split_stdlib()[1]
    texts = data.load_texts(args.text) if args.text else texts
    rows = evaluate(configs, tasks[: args.limit], texts, args.windows, device=args.device,
                    tensor_parallel_size=args.tensor_parallel_size)  # fmt: skip
    print(eval_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="redline", description="Low-latency LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print tokens/s")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text prompt")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--draft", default=None, help="EAGLE-3 draft directory or hub id (speculative decoding)")
    g.add_argument("--num-draft-tokens", type=int, default=3, help="draft length K (1..8)")
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the decode step and the prefill; every shape compiles at start-up (time printed)",
    )
    g.add_argument("--pdl", action="store_true", help="programmatic dependent launch (Hopper+ GPUs)")
    g.add_argument("--kv-cache-dtype", default=None, help="fp8 | bfloat16 | float32 (default: the model's)")
    add_kv_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="print the architecture, sizes and layer pattern")
    i.add_argument("--model", required=True, type=Path)
    i.add_argument("--revision", default=None, help="with a hub id: the branch, tag or commit (default main)")
    add_tensor_parallel_arg(i)
    i.set_defaults(func=cmd_info)

    r = sub.add_parser("init-random", help="write a random tiny checkpoint (for smoke tests)")
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--vocab-size", type=int, default=512)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=cmd_init_random)

    from redline.train.draft import DraftRecipe
    from redline.train.target import TargetRecipe

    t = sub.add_parser("train-target", help="train the demo target on the standard library's source")
    t.add_argument("--out", required=True, type=Path)
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    _add_recipe_args(t, TargetRecipe)
    t.set_defaults(func=cmd_train_target)

    d = sub.add_parser("train-draft", help="train an EAGLE-3 draft for a target (training-time test)")
    d.add_argument("--target", required=True, type=Path, help="target checkpoint directory or .gguf")
    d.add_argument("--out", required=True, type=Path)
    d.add_argument(
        "--data",
        default=None,
        help="sharegpt (first turns of its training conversations, answered by the target), or a JSONL, "
        "text file or directory of text (default: the standard library's source)",
    )
    d.add_argument(
        "--budget-minutes",
        type=float,
        default=None,
        help="size the answers and the training steps to this wall time (default: the recipe's counts)",
    )
    d.add_argument("--resume", action="store_true", help="continue whatever stage an interrupted run reached")
    _add_recipe_args(d, DraftRecipe)
    d.set_defaults(func=cmd_train_draft)

    m = sub.add_parser(
        "demo", help="SmolLM2 chats with and without EAGLE-3 (the first run trains its draft, ~15 minutes)"
    )
    m.add_argument("--prompts", type=int, default=3, help="held-out ShareGPT and HumanEval prompts, each")
    m.add_argument("--max-tokens", type=int, default=128)
    m.add_argument(
        "--num-draft-tokens", type=int, default=None, help="K (default 1: the fastest K for the demo's draft)"
    )
    m.add_argument(
        "--compile", action="store_true", help="torch.compile the decode step and prefill (longer warm-up)"
    )
    m.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="of the chats (bfloat16 is faster where the CPU has it, but its greedy texts can part at "
        "near-ties: the verify rounds K + 1 rows differently from one)",
    )
    m.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="HF vs redline vs redline + EAGLE-3 (--model), or load a server (--url)")
    b.add_argument("--model", type=Path, default=None, help="checkpoint directory or llama .gguf file")
    b.add_argument("--url", default=None, help="server load test: base URL of an OpenAI-compatible server")
    b.add_argument(
        "--concurrency", type=_int_list, default=[1, 2, 4, 8, 16], help="with --url: client counts"
    )
    b.add_argument("--requests-per-client", type=int, default=2, help="with --url")
    b.add_argument("--api-key", default=None, help="with --url")
    b.add_argument(
        "--dataset", choices=["sharegpt"], default=None, help="with --url: replay held-out conversations"
    )
    b.add_argument("--num-prompts", type=int, default=None, help="with --dataset: requests (default 100)")
    b.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="with --dataset: Poisson arrivals per s (default inf)",
    )
    b.add_argument(
        "--max-concurrency", type=int, default=None, help="with --dataset: most requests in flight"
    )
    b.add_argument(
        "--max-output-tokens", type=int, default=None, help="with --dataset: cap on max_tokens (default 256)"
    )
    b.add_argument(
        "--tokenizer", type=Path, default=None, help="with --dataset: the served model's directory or .gguf"
    )
    b.add_argument("--ignore-eos", action="store_true", help="with --dataset: generate exactly max_tokens")
    b.add_argument("--seed", type=int, default=0, help="with --dataset: seed of the arrival times")
    b.add_argument(
        "--data",
        choices=["sharegpt", "humaneval"],
        default=None,
        help="with --model: prompts from this held-out set (default: the stdlib held-out files)",
    )
    b.add_argument("--draft", type=Path, default=None)
    b.add_argument("--num-draft-tokens", type=_int_list, default=[1, 2, 3, 4, 5], help="e.g. 1,2,3")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--prompts", type=int, default=4)
    b.add_argument("--prompt-len", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--dtype", default="float32")
    add_tensor_parallel_arg(b)
    b.add_argument(
        "--modes",
        type=lambda text: [m for m in text.split(",") if m],
        default=["eager"],
        help="redline's modes to run: eager, compiled or eager,compiled",
    )
    b.add_argument("--compile", action="store_true", help="the same as --modes compiled")
    b.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    b.add_argument(
        "--no-llama-cpp",
        action="store_true",
        help="with a .gguf --model: skip llama.cpp (run when llama-cpp-python is installed)",
    )
    b.add_argument("--json", type=Path, default=None)
    b.add_argument("--plot", type=Path, default=None, help="PNG path")
    b.set_defaults(func=cmd_bench)

    gg = sub.add_parser(
        "import-gguf", help="a llama GGUF file as a Hugging Face directory (dequantized, safetensors)"
    )
    gg.add_argument("gguf", type=Path, help="the .gguf file (llama architecture)")
    gg.add_argument("out", type=Path, help="the directory to write (new or empty)")
    gg.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32: the weights' dtype")
    gg.add_argument("--max-shard-gb", type=float, default=None, help="safetensors shard limit in GB")
    gg.set_defaults(func=cmd_import_gguf)

    q = sub.add_parser("quantize", help="FP8 weights (per-channel scales), compressed-tensors layout")
    q.add_argument("--model", required=True, type=Path)
    q.add_argument("--out", required=True, type=Path)
    q.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="safetensors shard limit in GB (HF's default: 5)"
    )
    q.set_defaults(func=cmd_quantize)

    e = sub.add_parser("eval", help="BF16 vs FP8 vs speculation: perplexity, KL, agreement, task accuracy")
    e.add_argument("--model", required=True, type=Path)
    e.add_argument(
        "--data", required=True, help="humaneval | sharegpt | JSONL task file (math, choice, code)"
    )
    e.add_argument("--limit", type=int, default=None, help="evaluate the first N tasks only")
    e.add_argument("--compare", action="append", default=[], help="fp8 | bf16 | fp32 | spec:DRAFT_DIR | DIR")
    e.add_argument("--dtype", default="bf16", help="the base configuration: bf16 | fp32 | fp8")
    e.add_argument(
        "--text",
        type=Path,
        default=None,
        help="held-out text for perplexity (default: the set's own, or the stdlib held-out files)",
    )
    e.add_argument("--windows", type=int, default=16, help="256-token windows of text for perplexity / KL")
    e.add_argument("--device", default="cpu")
    add_tensor_parallel_arg(e)
    e.add_argument("--json", type=Path, default=None)
    e.set_defaults(func=cmd_eval)

    from redline.server.serve import add_parser as add_serve_parser

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from redline.engine.failures import DeviceUnusableError, GenerationError  # imports torch: after --help
    from redline.parallel import torchrun

    if torchrun.is_follower():  # started by torchrun, not rank 0: serve rank 0's calls (parallel/torchrun.py)
        return torchrun.follow()

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # configuration and input errors: one clear line
        print(f"redline: error: {e}", file=sys.stderr)
        return 2
    except (GenerationError, DeviceUnusableError, ConnectionError) as e:  # the engine or a server failed
        print(f"redline: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
