"""Command line: `redline generate | info | init-random`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from redline.config import ModelConfig


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")


def cmd_generate(args: argparse.Namespace) -> int:
    from redline import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        draft=args.draft,
        num_draft_tokens=args.num_draft_tokens,
        compile=args.compile,
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


def cmd_info(args: argparse.Namespace) -> int:
    c = ModelConfig.from_dir(args.model)
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
    return 0


def cmd_init_random(args: argparse.Namespace) -> int:
    from redline.models.random_init import write_random_model

    out = write_random_model(args.out, vocab_size=args.vocab_size, seed=args.seed)
    print(f"wrote a random tiny Llama checkpoint to {out}")
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
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--draft", type=Path, default=None, help="EAGLE-3 draft directory (speculative decoding)")
    g.add_argument("--num-draft-tokens", type=int, default=3, help="draft length K (1..8)")
    g.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="print the architecture, sizes and layer pattern")
    i.add_argument("--model", required=True, type=Path)
    i.set_defaults(func=cmd_info)

    r = sub.add_parser("init-random", help="write a random tiny checkpoint (for smoke tests)")
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--vocab-size", type=int, default=512)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=cmd_init_random)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # configuration and input errors: one clear line
        print(f"redline: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
