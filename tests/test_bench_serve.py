"""The serving benchmark (`redline bench --url --dataset sharegpt`) against a live server on the tiny
trained pair, and the benchmark prompts taken from the held-out sets."""

from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from live_server import live  # noqa: E402

from redline import LLM  # noqa: E402
from redline.benchmark.load import Pace, replay  # noqa: E402
from redline.benchmark.prompts import MAX_PROMPT_TOKENS, Request, engine_prompts, sharegpt_requests  # noqa: E402
from redline.benchmark.serve_report import percentile, summarize  # noqa: E402
from redline.cli import main  # noqa: E402
from redline.data import humaneval, sharegpt  # noqa: E402
from redline.server.app import Server  # noqa: E402
from redline.tokenizer import Tokenizer  # noqa: E402

MODEL = "tiny"
CONTEXT = 512


@pytest.fixture(scope="module")
def served(trained):
    llm = LLM(trained / "target", dtype="float32", max_batch=4, max_seq_len=CONTEXT, draft=trained / "draft")
    server = Server(llm, MODEL)
    with live(server) as url:
        yield server, url


def bench(url: str, tokenizer_dir, out, flags: str) -> dict:
    argv = ["bench", "--url", url, "--dataset", "sharegpt", "--tokenizer", str(tokenizer_dir)]
    assert main([*argv, "--json", str(out), *flags.split()]) == 0
    return json.loads(out.read_text())


def test_replays_held_out_conversations_with_their_real_lengths(served, trained, tmp_path, capsys):
    _, url = served
    result = bench(
        url,
        trained / "target",
        tmp_path / "a.json",
        "--num-prompts 6 --max-concurrency 2 --max-output-tokens 12 --ignore-eos",
    )
    expected = sharegpt_requests(Tokenizer.from_dir(trained / "target"), 6, 12, CONTEXT, ignore_eos=True)
    assert (result["completed"], result["failed"], result["max_concurrency"]) == (6, 0, 2)
    # the server's counts equal ours: chat template applied there as here, max_tokens from the real answers
    assert result["total_input_tokens"] == sum(r.prompt_tokens for r in expected)
    assert result["total_output_tokens"] == sum(r.max_tokens for r in expected)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        mean, median, p99 = (result[f"{s}_{metric}_ms"] for s in ("mean", "median", "p99"))
        assert 0 < median <= p99 and 0 < mean <= p99, metric
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration"])
    assert 1.0 <= result["acceptance_length"] <= 4.0  # the server's draft, K = 3
    assert 0.0 <= result["prefix_cache_hit_rate"] <= 1.0  # the server looked up every prompt
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "P99 TPOT (ms):" in printed
    assert "Prefix cache hit rate (server):" in printed


def test_poisson_arrivals(served, trained, tmp_path):
    _, url = served
    result = bench(
        url,
        trained / "target",
        tmp_path / "b.json",
        "--num-prompts 3 --request-rate 20 --max-output-tokens 4 --seed 1",
    )
    assert (result["completed"], result["failed"]) == (3, 0)
    assert result["settings"]["request_rate"] == 20.0 and result["settings"]["seed"] == 1


def test_a_request_the_server_fails_is_counted_not_fatal(served, trained, tmp_path, monkeypatch):
    server, url = served
    tokenizer = Tokenizer.from_dir(trained / "target")
    doomed = tokenizer.encode_chat(list(sharegpt_requests(tokenizer, 5, 8, CONTEXT, True)[2].prompt))
    runner = server.llm.runner
    prefill = runner.prefill.run

    def failing(batch):  # the third request's prefill raises (after its 200 status line)
        if any(c.end == len(doomed) and c.tokens == tuple(doomed[c.start :]) for c in batch.chunks):
            raise RuntimeError("injected prefill failure")  # (its start may come from the prefix cache)
        return prefill(batch)

    monkeypatch.setattr(runner.prefill, "run", failing)
    result = bench(
        url,
        trained / "target",
        tmp_path / "c.json",
        "--num-prompts 5 --max-concurrency 1 --max-output-tokens 8 --ignore-eos",
    )
    assert (result["completed"], result["failed"]) == (4, 1)
    assert "prefill failed (request id" in result["errors"][0]  # the cause is in the server's log only


def test_rejected_and_unreachable_requests_fail_alone(served):
    _, url = served
    requests = [Request("def f():", 4), Request("def g():", 10**6), Request("def h():", 4)]
    run = replay(url, MODEL, requests, Pace(max_concurrency=1))
    assert [r.ok for r in run.results] == [True, False, True]
    assert "HTTP 400" in run.results[1].error
    summary = summarize(run)
    assert (summary["completed"], summary["failed"]) == (2, 1)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a port nobody listens on
    closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    run = replay(closed, MODEL, requests[:2], Pace())
    sock.close()
    assert [r.ok for r in run.results] == [False, False] and "ConnectError" in run.results[0].error
    assert summarize(run)["completed"] == 0


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0


def test_engine_prompts_come_from_the_held_out_sets(trained):
    tokenizer = Tokenizer.from_dir(trained / "target")
    assert engine_prompts(tokenizer, "humaneval", 3) == [
        tokenizer.encode(p.prompt) for p in humaneval.problems()[:3]
    ]
    chats = [tokenizer.encode_chat([c.messages[0]]) for c in sharegpt.conversations("held_out")[:40]]
    assert (
        engine_prompts(tokenizer, "sharegpt", 3)
        == [ids for ids in chats if len(ids) <= MAX_PROMPT_TOKENS][:3]
    )
    with pytest.raises(ValueError, match="unknown data set"):
        engine_prompts(tokenizer, "mmlu", 1)


def test_sharegpt_requests_fit_the_context(trained):
    tokenizer = Tokenizer.from_dir(trained / "target")
    requests = sharegpt_requests(tokenizer, 20, 64, 256, ignore_eos=False)
    answers = {c.messages[0]["content"]: c.messages[1]["content"] for c in sharegpt.conversations("held_out")}
    assert len(requests) == 20
    for r in requests:
        question = r.prompt[0]
        assert question["role"] == "user" and r.prompt_tokens == len(tokenizer.encode_chat([question]))
        real = len(tokenizer.encode(answers[question["content"]], add_special_tokens=False))
        assert r.max_tokens == min(real, 64) and real >= 4  # the real first answer's length, capped
        assert r.prompt_tokens >= 4 and r.prompt_tokens + r.max_tokens <= 256
    with pytest.raises(ValueError, match="held-out ShareGPT conversations fit"):
        sharegpt_requests(tokenizer, 10_000, 64, 256, ignore_eos=False)
