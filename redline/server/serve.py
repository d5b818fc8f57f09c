"""`redline serve`: load the model (and draft) as the engine flags say, run uvicorn.

The engine loop runs on the main thread and uvicorn on another. Ctrl-C or SIGTERM exits 0; if the engine
loop dies, or the HTTP server ends by itself, the process exits 1 instead of serving nothing.

The mode (--mode, an engine option: engine_config.py) sets the slots and prefill defaults;
--no-speculation serves without speculation (the draft or n-gram lookup: an A/B switch).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
from pathlib import Path

from redline.engine_config import EngineConfig, SpeculativeConfig
from redline.engine_flags import add_engine_args, config_from_args


def served_name(model: str) -> str:
    """The model id clients send by default: a directory's name, a .gguf file's stem, a hub id itself
    (as vLLM serves it). "ckpt/llama-8b" (a directory) -> "llama-8b"; "meta-llama/Llama-3.1-8B" (no such
    directory) -> "meta-llama/Llama-3.1-8B"."""
    path = Path(model).expanduser()  # as hub.resolve reads it
    if not path.exists():
        return model
    return path.stem if path.suffix == ".gguf" else path.name


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config from the serve command line: the model positional (as `vllm serve ORG/NAME`)
    or --model, not both; --no-speculation drops the draft."""
    if args.model_arg and args.model and args.model_arg != args.model:
        raise ValueError(f"two models given: {args.model_arg!r} and --model {args.model!r}")
    model = args.model_arg or args.model
    if not model:
        raise ValueError(
            "no model given: redline serve MODEL (a directory, a .gguf file or a hub id ORG/NAME)"
        )
    config = config_from_args(args, model=model).answering_at_once()
    if args.no_speculation:
        config = dataclasses.replace(config, speculative=SpeculativeConfig())
    return config


def serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from redline.server.app import Server, create_app
        from redline.server.http_timeouts import uvicorn_config
        from redline.server.web_policy import WebPolicy
    except ImportError as e:
        raise ValueError(f"redline serve needs fastapi, uvicorn and prometheus-client ({e}); "
                         "pip install 'redline[serve]'") from e  # fmt: skip
    from redline import LLM

    log = logging.getLogger("redline.server")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config(args)
    model, scheduler = config.load.model, config.scheduler
    if scheduler.mode == "min-latency" and not config.speculation:
        log.warning("min-latency mode without a draft or n-gram lookup: serving without speculation")
    llm = LLM(config=config)
    if llm.warmup_s:
        log.info("warm-up: every prefill and step shape compiled in %.1f s", llm.warmup_s)
    name = args.served_model_name or served_name(model)
    api_key = args.api_key or os.environ.get("REDLINE_API_KEY")
    metrics_key = args.metrics_api_key or os.environ.get("REDLINE_METRICS_API_KEY")
    policy = WebPolicy.for_bind(args.host, args.allowed_hosts, args.allowed_origins)
    if not policy.loopback_only and not policy.allowed_hosts and not api_key:
        exposed = "anyone who can reach it may use it, and web pages can read its GET answers (DNS rebinding)"
        log.warning("listening on %s with neither --api-key nor --allowed-hosts: %s", args.host, exposed)
    server = Server(llm, name, api_key, max_queue=args.max_queue, tool_format=args.tool_call_parser,
                    metrics_api_key=metrics_key, policy=policy,
                    read_timeout_s=args.request_read_timeout)  # fmt: skip
    log.info(
        "serving %s as %r on http://%s:%d (%s: %d slots, speculation %s, context %d tokens)",
        model, name, args.host, args.port, scheduler.mode, scheduler.slots,
        f"K={llm.num_draft_tokens}" if config.speculation else "off", llm.max_seq_len,
    )  # fmt: skip
    app = create_app(server, start_engine=False)
    listen = uvicorn_config(app, server.metrics, args.request_read_timeout, args.keep_alive_timeout,
                            host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=5)  # fmt: skip
    http = uvicorn.Server(listen)  # on a second thread it leaves signals alone: Ctrl-C reaches main

    def run_http() -> None:
        try:
            http.run()
        except SystemExit:  # uvicorn's way out when it cannot start (the port is taken, say); it logged why
            pass
        finally:  # the HTTP server ended: nobody is left to serve
            server.engine.stop()

    thread = threading.Thread(target=run_http, name="redline-http", daemon=True)
    thread.start()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` shuts down like Ctrl-C
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
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    help = "checkpoint directory, llama .gguf file or Hugging Face Hub id (ORG/NAME); or --model"
    s.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help=help)
    add_engine_args(s)
    http = s.add_argument_group("server")
    http.add_argument(
        "--no-speculation", action="store_true", help="ignore the draft or n-gram lookup (an A/B switch)"
    )
    http.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    parsers = ["llama3_json", "pythonic"]
    help = "how the model writes tool calls (default: the format its chat template writes calls in, else "
    help += "Llama 4's pythonic, Llama 3's JSON)"
    http.add_argument("--tool-call-parser", choices=parsers, default=None, help=help)
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument(
        "--api-key", help="require Authorization: Bearer KEY on every path but /health (or REDLINE_API_KEY)"
    )
    help = "the key /metrics takes instead of --api-key (or REDLINE_METRICS_API_KEY); with neither, "
    help += "/metrics is open (it exposes counts and latencies, no request content)"
    http.add_argument("--metrics-api-key", help=help)
    help = "Host names answered besides loopback ones when bound to a loopback address; bound elsewhere, "
    help += "the only ones answered if given ('*': any)"
    http.add_argument("--allowed-hosts", nargs="+", default=[], metavar="HOST", help=help)
    help = "web origins answered, with CORS headers (e.g. http://localhost:3000; '*': any); by default "
    help += "none: a request a browser marks with an Origin is refused"
    http.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN", help=help)
    help = "seconds a request's headers, and then its body, may take to arrive (408 after)"
    http.add_argument("--request-read-timeout", type=float, default=30.0, metavar="S", help=help)
    help = "seconds an idle keep-alive connection stays open"
    http.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S", help=help)
    help = "model id clients send (default: the directory's name, a hub id itself)"
    http.add_argument("--served-model-name", help=help)
    s.set_defaults(func=serve)
