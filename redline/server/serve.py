"""`redline serve`: load the model (and draft), pick the mode's batch and speculation, run uvicorn.

The engine loop runs on the main thread and uvicorn on another. Ctrl-C or SIGTERM exits 0; if the engine
loop dies, or the HTTP server ends by itself, the process exits 1 instead of serving nothing.

min-latency: at most MIN_LATENCY_SLOTS slots, speculation whenever a draft is given, every prompt
prefilled whole (batch-1 latency first).
max-throughput: --max-batch slots (default 256), as many running as the KV pool holds; speculation with
a draft unless --no-speculation; prefill in forwards of --max-prefill-tokens (default 2,048), so running
streams keep decoding while a long prompt arrives.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading

MIN_LATENCY_SLOTS = 4
MAX_THROUGHPUT_SLOTS = 256  # admitted as the KV pool holds them
MAX_THROUGHPUT_PREFILL_TOKENS = 2048  # per prefill forward: long prompts in chunks between decode steps


def mode_settings(
    mode: str, max_batch: int | None, has_draft: bool, no_speculation: bool
) -> tuple[int, bool]:
    """(slots, speculate) for a mode. min-latency, --max-batch 16 -> (4, True) with a draft."""
    if mode == "min-latency":
        return min(max_batch or MIN_LATENCY_SLOTS, MIN_LATENCY_SLOTS), has_draft and not no_speculation
    return max_batch or MAX_THROUGHPUT_SLOTS, has_draft and not no_speculation


def served_name(model: str) -> str:
    """The model id clients send by default: a directory's name, a .gguf file's stem, a hub id itself
    (as vLLM serves it). "ckpt/llama-8b" (a directory) -> "llama-8b"; "meta-llama/Llama-3.1-8B" (no such
    directory) -> "meta-llama/Llama-3.1-8B"."""
    from pathlib import Path

    path = Path(model).expanduser()  # as hub.resolve reads it
    if not path.exists():
        return model
    return path.stem if path.suffix == ".gguf" else path.name


def _model_argument(args: argparse.Namespace) -> str:
    """The model, positional (as `vllm serve ORG/NAME`) or --model; not both, not neither."""
    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    model = args.model or args.model_flag
    if not model:
        raise ValueError(
            "no model given: redline serve MODEL (a directory, a .gguf file or a hub id ORG/NAME)"
        )
    return model


def speculative_config(text: str) -> tuple[str, int]:
    """vLLM's --speculative-config JSON -> (draft, K): '{"method": "eagle3", "model": "DIR",
    "num_speculative_tokens": 3}' -> ("DIR", 3)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from e
    if not isinstance(config, dict) or config.get("method") not in ("eagle3", None):
        raise ValueError(f'--speculative-config: only "method": "eagle3" is supported, got {config!r}')
    if not isinstance(config.get("model"), str):
        raise ValueError('--speculative-config needs "model": the EAGLE-3 draft directory or hub id')
    k = config.get("num_speculative_tokens", 3)
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer, got {k!r}")
    return config["model"], k


def engine_options(args: argparse.Namespace) -> dict:
    """LLM(...)'s arguments from the serve command line (redline's flags or their vLLM spellings)."""
    draft, k = args.draft, args.num_draft_tokens
    if args.speculative_config is not None:
        if draft is not None:
            raise ValueError("give the draft once: --draft or --speculative-config")
        draft, k = speculative_config(args.speculative_config)
    slots, speculate = mode_settings(args.mode, args.max_batch, draft is not None, args.no_speculation)
    prefill_tokens = args.max_prefill_tokens
    if prefill_tokens is None and args.mode == "max-throughput":
        prefill_tokens = MAX_THROUGHPUT_PREFILL_TOKENS
    return dict(
        model=_model_argument(args), revision=args.revision, dtype=args.dtype, device=args.device,
        max_batch=slots, max_seq_len=args.max_seq_len, draft=draft if speculate else None,
        num_draft_tokens=k, compile=args.compile, tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, prefix_caching=args.prefix_caching,
        max_prefill_tokens=prefill_tokens,
    )  # fmt: skip


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from redline.server.app import Server, create_app
    except ImportError as e:
        raise ValueError(f"redline serve needs fastapi, uvicorn and prometheus-client ({e}); "
                         "pip install 'redline[serve]'") from e  # fmt: skip
    from redline import LLM

    log = logging.getLogger("redline.server")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = engine_options(args)
    model, slots, speculate = options["model"], options["max_batch"], options["draft"] is not None
    if args.mode == "min-latency" and not speculate:
        log.warning("min-latency mode without a draft: serving without speculation")
    llm = LLM(**options)
    if llm.warmup_s:
        log.info("warm-up: every prefill and step shape compiled in %.1f s", llm.warmup_s)
    name = args.served_model_name or served_name(model)
    api_key = args.api_key or os.environ.get("REDLINE_API_KEY")
    server = Server(llm, name, api_key, max_queue=args.max_queue)
    log.info(
        "serving %s as %r on http://%s:%d (%s: %d slots, speculation %s, context %d tokens)",
        model, name, args.host, args.port, args.mode, slots,
        f"K={llm.num_draft_tokens}" if speculate else "off", llm.max_seq_len,
    )  # fmt: skip
    app = create_app(server, start_engine=False)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
    )
    http = uvicorn.Server(
        config
    )  # on a second thread it leaves signals alone: Ctrl-C reaches the main thread

    def run_http() -> None:
        try:
            http.run()
        except SystemExit:  # uvicorn's way out when it cannot start (the port is taken, say); it logged why
            pass
        finally:  # the HTTP server ended: nobody is left to serve
            server.engine.stop()

    thread = threading.Thread(target=run_http, name="redline-http", daemon=True)
    thread.start()
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` shuts down like Ctrl-C
    try:
        died = not server.engine.run()  # the model stays on the main thread
    except KeyboardInterrupt:
        log.info("shutting down")
        return 0
    finally:
        http.should_exit = True
        thread.join(timeout=10)
        llm.close()  # tensor-parallel workers
    log.error("exiting: %s", server.engine.problem() if died else "the HTTP server stopped")
    return 1


def add_parser(sub) -> None:

    from redline.cli import add_kv_args, add_tensor_parallel_arg

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    help = "checkpoint directory, llama .gguf file or Hugging Face Hub id (ORG/NAME); or --model"
    s.add_argument("model", nargs="?", default=None, help=help)
    s.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="the same as MODEL")
    s.add_argument("--revision", default=None, help="with a hub id: the branch, tag or commit (default main)")
    s.add_argument("--draft", default=None, help="EAGLE-3 draft directory or hub id")
    s.add_argument("--num-draft-tokens", type=int, default=3)
    s.add_argument("--mode", choices=("min-latency", "max-throughput"), default="min-latency")
    help = "slots (max-throughput default 256); vLLM's --max-num-seqs"
    s.add_argument("--max-batch", "--max-num-seqs", type=int, default=None, help=help)
    s.add_argument("--no-speculation", action="store_true", help="ignore --draft (max-throughput A/B)")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    help = "context window (default: the model's, <= 4096); vLLM's --max-model-len"
    s.add_argument("--max-seq-len", "--max-model-len", type=int, default=None, help=help)
    help = "float32 | bfloat16 | float16 | fp8 | auto (the checkpoint's)"
    s.add_argument("--dtype", default="float32", help=help)
    help = """vLLM's form of --draft: '{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}'"""
    s.add_argument("--speculative-config", default=None, metavar="JSON", help=help)
    s.add_argument("--device", default="cpu")
    add_tensor_parallel_arg(s)
    add_kv_args(s, f"min-latency: whole prompts; max-throughput: {MAX_THROUGHPUT_PREFILL_TOKENS}")
    s.add_argument("--compile", action="store_true")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (or REDLINE_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: the dir name)")
    s.set_defaults(func=serve)
