"""Command line: `redline generate | info | init-random | train-target | train-draft | demo | bench |
import-gguf | quantize | eval | serve`.

The engine's flags come from EngineConfig's fields (engine_flags.py), so every command that builds an
engine spells them alike; bench, eval and serve parse theirs in their own modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from redline.engine_flags import add_engine_args, config_from_args

if typing.TYPE_CHECKING:
    from redline.engine.request import Completion

ONE_SLOT = {"max_num_seqs": 1}  # generate completes one prompt: one slot, the fewest shapes to compile


def cmd_generate(args: argparse.Namespace) -> int:
    from redline import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )  # fmt: skip
    llm = LLM(config=config_from_args(args).answering_at_once())
    if llm.warmup_s:
        print(
            f"[redline] warm-up (compiling every prefill and step shape): {llm.warmup_s:.1f} s",
            file=sys.stderr,
        )
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.chat}]) if args.chat else args.prompt
    try:
        stream = llm.stream(prompt, params)
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
        print(_summary(stream.completion), file=sys.stderr)
    finally:
        llm.close()  # a compile in the background stops; tensor-parallel workers end
    return 0


def _summary(c: Completion) -> str:
    summary = (
        f"[redline] prompt tokens: {c.prompt_tokens} | generated tokens: {c.completion_tokens} "
        f"| finish: {c.finish_reason} | time to first token: {c.ttft_s * 1000:.1f} ms "
        f"| {c.tokens_per_s:.1f} tokens/s per user"
    )
    if c.acceptance_length is not None:
        rates = ", ".join(f"{r:.2f}" for r in c.acceptance_rates or [])
        summary += f" | acceptance length: {c.acceptance_length:.2f} (per position: {rates})"
    return summary


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from redline.config import ModelConfig
    from redline.models.source import local_model
    from redline.runner.build import backends_of

    config = config_from_args(args)
    model_dir = local_model(config.load.model, config.load.revision)
    c = ModelConfig.from_dir(model_dir)
    print(f"architecture: {c.architecture} ({c.family})")
    print(f"parameters: ~{c.num_params_estimate / 1e6:.1f}M")
    print(
        f"vocab: {c.vocab_size} | hidden: {c.hidden_size} | layers: {c.num_layers} | heads: {c.num_heads} "
        f"(kv {c.num_kv_heads}, head_dim {c.head_dim}) | mlp: {c.intermediate_size}"
    )
    scaling = f" (factor {c.rope.factor:g})" if c.rope.scaling == "llama3" else ""
    print(f"rope: theta {c.rope.theta:g}, scaling {c.rope.scaling}{scaling}")
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
    device = torch.device(config.load.device)
    dtype = config.load.given_or_fast_dtype
    resolved = dataclasses.replace(
        config, load=dataclasses.replace(config.load, model=str(model_dir), dtype=dtype)
    )
    chosen = backends_of(resolved, device).describe() if dtype != "auto" else {}
    if chosen:
        print(f"kernels on {device} in {dtype}: " + "; ".join(f"{k}: {v}" for k, v in chosen.items()))
    if config.parallel.tensor_parallel_size > 1:
        print(
            _per_rank(model_dir, config.parallel.tensor_parallel_size, config.parallel.enable_expert_parallel)
        )
    return 0


def _per_rank(model_dir: Path, size: int, expert_parallel: bool) -> str:
    """What each of `size` tensor-parallel ranks holds (every rank's shard has the same shapes), and its
    bytes as loaded: FP8 weights 1 byte, their fp32 scales 4, an int checkpoint's tensors as stored (packed
    codes, scales, zeros, g_idx; its linears' weights counted as in_features x out_features; the layout
    they load into differs by a few percent), everything else bf16."""
    import torch

    from redline.models.build import skeleton
    from redline.models.int_checkpoint import CheckpointLinear
    from redline.parallel.group import TensorParallel

    model = skeleton(model_dir, TensorParallel(0, size, expert_parallel=expert_parallel))
    model.finish_loading()
    packed = [m for m in model.modules() if isinstance(m, CheckpointLinear)]
    count, loaded = sum(m.in_features * m.out_features for m in packed), 0
    for name, p in model.named_parameters():
        module, _, key = name.rpartition(".")
        if isinstance(model.get_submodule(module), CheckpointLinear) and key != "bias":  # as stored
            loaded += p.numel() * p.element_size()
        else:
            count += p.numel()
            loaded += p.numel() * (1 if p.dtype == torch.float8_e4m3fn else 4 if "scale" in key else 2)
    return (
        f"tensor parallel {size}: {count:,} parameters per rank, {loaded:,} bytes each as loaded "
        f"({loaded / 2**30:.2f} GiB)"
    )


def cmd_init_random(args: argparse.Namespace) -> int:
    from redline.train.random_init import write_random_model

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
    from redline.models.source import local_model
    from redline.train.draft import DraftRecipe, train_draft

    data = resolve(args.data, training=True) if args.data else None
    summary = train_draft(
        local_model(args.target), args.out, _recipe(DraftRecipe, args), data, resume=args.resume,
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

    k = args.num_draft_tokens or DEMO_K
    run_demo(args.prompts, args.max_tokens, k, not args.eager, args.dtype, not args.dequantized)
    return 0


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from redline.dtypes import parse_dtype
    from redline.models.gguf import import_gguf
    from redline.models.shards import DEFAULT_SHARD_BYTES

    if args.out.exists() and any(args.out.iterdir()):
        raise ValueError(f"{args.out} is not empty: import into a new directory")
    shard_bytes = DEFAULT_SHARD_BYTES if args.max_shard_gb is None else int(args.max_shard_gb * 10**9)
    import_gguf(args.gguf, args.out, parse_dtype(args.dtype), max_shard_bytes=shard_bytes)
    print(f"wrote {args.out}: {', '.join(sorted(p.name for p in args.out.iterdir()))}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from redline.models.quantized_checkpoint import quantize_checkpoint

    shard_bytes = int(args.max_shard_gb * 10**9)
    counts = quantize_checkpoint(args.model, args.out, shard_bytes, args.scheme, args.group_size)
    done, total = counts["quantized_parameters"], counts["parameters"]
    print(f"wrote {args.out}: {done:,} of {total:,} parameters in {args.scheme} ({done / total:.0%})")
    return 0


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="complete one prompt and print tokens/s")
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
    add_engine_args(g, defaults=ONE_SLOT)
    g.set_defaults(func=cmd_generate)


def _add_model_tools(sub) -> None:
    i = sub.add_parser("info", help="print the architecture, sizes, layer pattern and the kernels chosen")
    add_engine_args(i, groups=("load", "parallel", "compilation"))
    i.set_defaults(func=cmd_info)

    r = sub.add_parser("init-random", help="write a random tiny checkpoint (for smoke tests)")
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--vocab-size", type=int, default=512)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=cmd_init_random)

    gg = sub.add_parser("import-gguf", help="a llama GGUF file as a Hugging Face directory (dequantized)")
    gg.add_argument("gguf", type=Path, help="the .gguf file (llama architecture)")
    gg.add_argument("out", type=Path, help="the directory to write (new or empty)")
    gg.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32: the weights' dtype")
    gg.add_argument("--max-shard-gb", type=float, default=None, help="safetensors shard limit in GB")
    gg.set_defaults(func=cmd_import_gguf)

    help = "a quantized copy in the compressed-tensors layout (vLLM, transformers and redline read it)"
    q = sub.add_parser("quantize", help=help)
    q.add_argument("--model", required=True, type=Path)
    q.add_argument("--out", required=True, type=Path)
    help = "fp8: e4m3 weights, per-channel scales, dynamic per-token activations; int4 / int8: W4A16 / W8A16"
    q.add_argument("--scheme", choices=("fp8", "int4", "int8"), default="fp8", help=help)
    help = "int4 / int8: weights a scale covers (default: int4 128, or 64 / 32 where 128 does not fit; int8: "
    help += "one per output channel)"
    q.add_argument("--group-size", type=int, choices=(32, 64, 128), default=None, help=help)
    help = "safetensors shard limit in GB (HF's default: 5)"
    q.add_argument("--max-shard-gb", type=float, default=5.0, help=help)
    q.set_defaults(func=cmd_quantize)


def _add_training(sub) -> None:
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
    help = "sharegpt (first turns of its training conversations, answered by the target), or a JSONL, text "
    d.add_argument(
        "--data", default=None, help=help + "file or directory of text (default: the stdlib source)"
    )
    help = "size the answers and the training steps to this wall time (default: the recipe's counts)"
    d.add_argument("--budget-minutes", type=float, default=None, help=help)
    d.add_argument("--resume", action="store_true", help="continue whatever stage an interrupted run reached")
    _add_recipe_args(d, DraftRecipe)
    d.set_defaults(func=cmd_train_draft)

    m = sub.add_parser("demo", help="SmolLM2 chats with and without EAGLE-3 (its draft ships with redline)")
    m.add_argument("--prompts", type=int, default=3, help="held-out ShareGPT and HumanEval prompts, each")
    m.add_argument("--max-tokens", type=int, default=128)
    help = "K (default 1: K = 3 was faster on ShareGPT but slower on raw HumanEval, BENCHMARKS.md)"
    m.add_argument("--num-draft-tokens", type=int, default=None, help=help)
    help = "run eagerly instead of compiled (no start-up compile; several times slower decoding)"
    m.add_argument("--eager", action="store_true", help=help)
    help = "of the chats (default: bfloat16 where the CPU computes it natively, float32 elsewhere)"
    m.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help=help)
    help = "run the import of the GGUF file (its weights dequantized), not the file's own Q4_1 / Q8_0 "
    help += "weights (the default where a C++ kernel multiplies them: AVX-512 BF16 or AVX2)"
    m.add_argument("--dequantized", action="store_true", help=help)
    m.set_defaults(func=cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    from redline.benchmark import command as bench
    from redline.evaluate import command as evaluate
    from redline.server import serve

    parser = argparse.ArgumentParser(prog="redline", description="Low-latency LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_model_tools(sub)
    _add_training(sub)
    bench.add_parser(sub)
    evaluate.add_parser(sub)
    serve.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from redline.engine.request import GenerationError  # imports torch: after --help
    from redline.failures import DeviceUnusableError
    from redline.runner import torchrun

    if torchrun.is_follower():  # started by torchrun, not rank 0: follow rank 0 (runner/torchrun.py)
        return torchrun.follow_rank_0()
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
