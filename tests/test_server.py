"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from live_server import live  # noqa: E402

from redline import LLM, SamplingParams  # noqa: E402
from redline.benchmark.serve_bench import (  # noqa: E402
    PREFIX_HITS,
    PREFIX_QUERIES,
    ServerDidNotStart,
    scrape_metrics,
    wait_until_healthy,
)
from redline.server.app import Server  # noqa: E402
from redline.server.engine_loop import EngineLoop, QueueFull  # noqa: E402
from redline.server.serve import add_parser, engine_config  # noqa: E402

MODEL = "tiny"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(trained) -> Server:
    llm = LLM(trained / "target", dtype="float32", max_batch=8, max_seq_len=512, draft=trained / "draft")
    return Server(llm, MODEL)


@pytest.fixture(scope="module")
def url(server) -> Iterator[str]:
    with live(server) as base:
        yield base


@pytest.fixture()
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_completion_matches_the_engine(client, server, trained):
    out = client.completions.create(model=MODEL, prompt="def main():", max_tokens=20, temperature=0)
    # a second engine: the server's own belongs to its engine thread (calling it here would race it)
    engine = LLM(trained / "target", dtype="float32", max_batch=8, max_seq_len=512, draft=trained / "draft")
    expected = engine.generate("def main():", SamplingParams(max_tokens=20))[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(server.llm.tokenizer.encode("def main():"))
    assert out.usage.completion_tokens == expected.completion_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_and_streaming_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    streamed = client.completions.create(
        model=MODEL, prompt="import os\n", max_tokens=16, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in streamed]
    whole = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=16, temperature=0)
    assert "".join(pieces) == whole.choices[0].text


def test_stop_strings_cut_the_text(client):
    base = client.completions.create(model=MODEL, prompt="class A:\n", max_tokens=40, temperature=0)
    text = base.choices[0].text
    stop = text[5:8]  # something the model is about to say
    assert stop
    out = client.completions.create(
        model=MODEL, prompt="class A:\n", max_tokens=40, temperature=0, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.usage.completion_tokens < base.usage.completion_tokens


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL, prompt="def f(x):", max_tokens=24, temperature=1.0, seed=seed
        )
        return out.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_sixteen_concurrent_streams_equal_each_request_alone(client, url):
    prompts = [f"def function_{i}(value):\n    " for i in range(16)]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=32, temperature=0).choices[0].text
        for p in prompts
    ]

    async def stream_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        async def one(prompt: str) -> str:
            chunks = await aclient.completions.create(
                model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in chunks])

        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(stream_all()) == alone


def test_disconnect_mid_stream_frees_the_slot(url, server):
    body = {
        "model": MODEL,
        "prompt": "x = 1\n",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url + "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        next(response.iter_lines())  # the first event arrived: the request holds a slot
    deadline = time.time() + 10
    while server.engine.stats().running or server.engine.queue_depth:
        assert time.time() < deadline, "slot not freed after the client disconnected"
        time.sleep(0.05)
    metrics = httpx.get(url + "/metrics").text
    assert 'redline_requests_total{outcome="cancelled"}' in metrics


def test_a_shared_prompt_prefix_is_served_from_the_cache(client, url):
    """Two prompts sharing a long start (new to this server): the first computes it all, the second
    finds its full blocks in the prefix cache; usage and /metrics say so alike."""
    shared = f"# run {time.time_ns()}\n" + "".join(f"v{i} = {i * 7919 % 1000}\n" for i in range(40))
    before = scrape_metrics(url)
    # 16 tokens take several steps: the counters (updated after each step) have seen the admission
    kw = dict(model=MODEL, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(prompt=shared + "a = 1", **kw)
    second = client.completions.create(prompt=shared + "b = 2", **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    after = scrape_metrics(url)
    assert after[PREFIX_HITS] - before[PREFIX_HITS] == cached
    assert after[PREFIX_QUERIES] - before[PREFIX_QUERIES] >= 2 * cached


def test_tokenize_and_detokenize_as_vllm_serves_them(url, server):
    tokenizer = server.llm.tokenizer
    messages = [{"role": "user", "content": "Write a loop."}]
    with httpx.Client(base_url=url, timeout=30) as http:
        out = http.post("/tokenize", json={"model": MODEL, "prompt": "def main():"}).json()
        assert out == {"count": len(tokenizer.encode("def main():")), "max_model_len": 512,
                       "tokens": tokenizer.encode("def main():")}  # fmt: skip
        bare = http.post("/tokenize", json={"prompt": "x = 1", "add_special_tokens": False}).json()
        assert bare["tokens"] == tokenizer.encode("x = 1", add_special_tokens=False)
        chat = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
        assert chat["tokens"] == tokenizer.encode_chat(messages)
        back = http.post("/detokenize", json={"model": MODEL, "tokens": out["tokens"]}).json()
        assert back == {"prompt": tokenizer.decode(out["tokens"])} and "def main():" in back["prompt"]
        for path, body, field in [
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/detokenize", {"tokens": [1, "a"]}, "tokens[1]"),
            ("/detokenize", {"tokens": [10**9]}, "tokens"),
            ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
        ]:
            response = http.post(path, json=body)
            assert response.status_code in (400, 404) and response.json()["error"]["param"] == field


LONG = "word " * 600


USER = [{"role": "user", "content": "x"}]
IMAGE = [{"role": "user", "content": [{"type": "image"}]}]
NO_SCHEMA = {"type": "json_schema"}  # json_schema missing
MALFORMED = [
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/v1/completions", b"[1, 2]", 400),
    ("POST", "/v1/completions", b'"a string"', 400),
    ("POST", "/v1/completions", b"\xff\xfe", 400),
    ("POST", "/v1/completions", {}, 400),
    ("POST", "/v1/completions", {"prompt": "hi"}, 400),
    ("POST", "/v1/completions", {"model": 3, "prompt": "hi"}, 400),
    ("POST", "/v1/completions", {"model": "other", "prompt": "hi"}, 404),
    ("POST", "/v1/completions", {"model": MODEL}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": 12}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": ["a"] * 65}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [1, True]}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1.5}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 10}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": -2}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "seed": "abc"}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 17}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": 5}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": list("abcdefghijklmnopq")}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"x": 1}}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "echo": "yes"}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": 9}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": IMAGE}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": ["hi"]}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_completion_tokens": -1}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "tools": [{"a": 1}]}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "min_p": 1.5}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "repetition_penalty": 0}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "response_format": NO_SCHEMA}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "tool_choice": "auto"}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "guided_json": '{"type": "objec'}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "(a"}, 400),
    ("POST", "/v1/completions", b"x" * (2 << 20), 413),
    ("GET", "/v1/completions", None, 405),
    ("GET", "/v1/nothing-here", None, 404),
    ("DELETE", "/v1/models", None, 405),
]  # fmt: skip


def expected_field(path: str, body: dict) -> str:
    """The field a malformed body's error must name: a missing required one, else the last (bad) key."""
    if not isinstance(body.get("model"), str) or body["model"] != MODEL:
        return "model"
    if len(body) == 1:
        return "messages" if "chat" in path else "prompt"
    if body.get("prompt") == LONG:
        return "max_tokens"  # prompt + max_tokens over the context window
    return list(body)[-1]


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(url, client):
    assert len(MALFORMED) >= 30
    with httpx.Client(base_url=url, timeout=30) as http:
        for method, path, body, status in MALFORMED:
            content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
            response = http.request(
                method, path, content=content, headers={"content-type": "application/json"}
            )
            assert response.status_code == status, (method, path, str(body)[:80], response.text[:200])
            error = response.json()["error"]
            assert error["message"] and error["type"], response.text
            if isinstance(body, dict):
                named = expected_field(path, body)
                assert named in error["message"] and error["param"].startswith(named), (body, error)
    out = client.completions.create(model=MODEL, prompt="def main():", max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens > 0


def test_api_key(trained, server):
    keyed = Server(server.llm, MODEL, api_key=KEY)
    with live(keyed) as base:
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in ok.models.list().data] == [MODEL]
        assert httpx.get(base + "/health").status_code == 200


def test_queue_full_is_429_with_retry_after(server, url, monkeypatch):
    def full(*args, **kwargs):
        raise QueueFull

    monkeypatch.setattr(server.engine, "submit", full)
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_engine_loop_bounds_its_queue(server):
    loop = EngineLoop(server.llm, max_queue=2)  # never started: nothing leaves the queue
    request = server.llm.make_request("hi", SamplingParams(max_tokens=2))
    loop.submit(request, lambda event: None)
    loop.submit(request, lambda event: None)
    with pytest.raises(QueueFull):
        loop.submit(request, lambda event: None)
    assert loop.queue_depth == 2


def test_modes():
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())

    def config(*flags: str):
        c = engine_config(parser.parse_args(["serve", "m", "--draft", "d", *flags]))
        return c.scheduler.slots, c.scheduler.prefill_tokens, c.speculation

    assert config() == (4, None, True)  # min-latency: 4 slots, whole prompts, speculation
    assert config("--max-num-seqs", "16") == (16, None, True)
    assert config("--mode", "max-throughput") == (256, 2048, True)
    assert config("--mode", "max-throughput", "--max-batch", "32", "--no-speculation") == (32, 2048, False)
    assert config("--mode", "max-throughput", "--max-num-batched-tokens", "512") == (256, 512, True)


def test_load_client_reports_every_level(url):
    from redline.benchmark.load import run_load

    result = run_load(url, [1, 3], requests_per_client=1, max_tokens=8)
    assert result["model"] == MODEL
    assert [r["concurrency"] for r in result["levels"]] == [1, 3]
    for level in result["levels"]:
        assert level["errors"] == 0 and level["requests"] == level["concurrency"]
        assert level["ttft_s_median"] > 0 and level["tps_user_median"] > 0 and level["tps_total"] > 0


def test_a_server_that_exits_while_starting_is_named_not_waited_for():
    """The benchmarks' start-up wait (serve_bench.wait_until_healthy): a process that exits with 3 before
    /health answers ends the wait at once with its exit code, and one that never answers ends it at the
    timeout; neither blocks for the default 10 minutes."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(ServerDidNotStart, match="exited with 3"):
        wait_until_healthy("http://127.0.0.1:9", dead)
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = time.monotonic()
        with pytest.raises(ServerDidNotStart, match="did not answer /health in 2 s"):
            wait_until_healthy("http://127.0.0.1:9", silent, timeout_s=2)
        assert time.monotonic() - start < 10
    finally:
        silent.kill()
