"""`redline eval`: configurations of one model side by side (evaluate/run.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from redline.engine_flags import QUANTIZING, add_engine_args


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="BF16 vs FP8 vs speculation: perplexity, KL, agreement, task accuracy")
    add_engine_args(e, groups=("load", "parallel"), skip=QUANTIZING)
    help = "humaneval | sharegpt | JSONL task file (math, choice, code)"
    e.add_argument("--data", required=True, help=help)
    e.add_argument("--limit", type=int, default=None, help="evaluate the first N tasks only")
    help = "fp8 | bf16 | fp32 | int4 | int8 | gguf (weight-only on load) | spec:DRAFT_DIR | DIR"
    e.add_argument("--compare", action="append", default=[], help=help)
    help = "held-out text for perplexity (default: the set's own, or the stdlib held-out files)"
    e.add_argument("--text", type=Path, default=None, help=help)
    e.add_argument("--windows", type=int, default=16, help="256-token windows of text for perplexity / KL")
    e.add_argument("--json", type=Path, default=None)
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from redline.data.sources import resolve
    from redline.dtypes import fast_dtype
    from redline.evaluate import public_sets
    from redline.evaluate.run import EvalConfig, eval_table, evaluate, parse_config
    from redline.evaluate.tasks import load_tasks
    from redline.train import data

    if not args.model:
        raise ValueError("redline eval needs --model")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    args.dtype = args.dtype or fast_dtype(args.device)  # the base's dtype, named in its label
    short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}  # the base's label, as --compare says
    label = short.get(args.dtype, args.dtype)
    configs = [EvalConfig(label, Path(args.model), args.dtype)]
    configs += [parse_config(spec, configs[0]) for spec in args.compare]
    source = resolve(args.data)
    if isinstance(source, str):  # a built-in set: its own held-out text for perplexity
        tasks, texts = public_sets.tasks(source), public_sets.texts(source)
    else:
        tasks, texts = load_tasks(source), data.split_stdlib()[1]
    texts = data.load_texts(args.text) if args.text else texts
    rows = evaluate(configs, tasks[: args.limit], texts, args.windows, device=args.device,
                    tensor_parallel_size=args.tensor_parallel_size,
                    expert_parallel=args.enable_expert_parallel)  # fmt: skip
    print(eval_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
