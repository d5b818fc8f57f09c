"""Failures that lose nothing: a request the engine fails fails alone, with an error to its caller; the
queue and slots stay right; /health tells whether the engine can serve; chat templates that raise are 400s.

Faults are injected where a real one cannot be provoked on CPU: the target's forward raises for one
prompt (as a CUDA out-of-memory would inside prefill), or the runner's decode step raises."""

from __future__ import annotations

import json
import signal
import socket
import threading
from pathlib import Path

import pytest
import torch

from redline import LLM, SamplingParams
from redline.cli import main
from redline.engine.request import GenerationError
from redline.failures import DeviceUnusableError, device_unusable

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from live_server import live  # noqa: E402

from redline.server.app import Server  # noqa: E402

MODEL = "tiny"
GOOD = [[5, 6, 7, 8], [9, 10, 11]]
BAD = [20, 21, 22, 23, 24]
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"
ILLEGAL = "CUDA error: an illegal memory access was encountered"
ALTERNATING = (
    "{% if messages[0]['role'] == 'system' %}{{ messages | length + 'x' }}{% endif %}"
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_llm(model_dir: Path, max_batch: int = 4) -> LLM:
    return LLM(model_dir, dtype="float32", max_batch=max_batch, max_seq_len=128)


@pytest.fixture(scope="module")
def model_dir(tied_llama_dir) -> Path:
    return tied_llama_dir


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return tiny_llm(model_dir)


def fail_prefill_of(monkeypatch, llm: LLM, prompt: list[int], error: Exception) -> None:
    """The target's forward raises `error` when a row of it runs `prompt` (its prefill), as an OOM would."""
    model = llm.runner.model
    forward = model.forward

    def failing(tokens: torch.Tensor, *args, **kwargs):
        if any(row[: len(prompt)].tolist() == prompt for row in tokens):  # rows padded to 16s
            raise error
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(model, "forward", failing)


def fail_decode(monkeypatch, llm: LLM, error: Exception, at: int = 0) -> None:
    """The runner's decode step number `at` (from 0, counted from now) raises `error`."""
    step, calls = llm.runner.run_step, [0]

    def failing(rows: int, kv_len: int, logits: bool, k: int | None = None) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == at + 1:
            raise error
        return step(rows, kv_len, logits, k)

    monkeypatch.setattr(llm.runner, "run_step", failing)


@pytest.mark.parametrize(
    "error, unusable",
    [
        (torch.AcceleratorError(ILLEGAL), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (RuntimeError("CUDA error: unspecified launch failure"), True),
        (torch.OutOfMemoryError(OOM), False),
        (torch.AcceleratorError("CUDA error: out of memory"), False),
        (RuntimeError("shape mismatch"), False),
        (ValueError("CUDA error in a message of the wrong type"), False),
    ],
)
def test_device_unusable_tells_sticky_device_errors_from_ordinary_ones(error, unusable):
    assert device_unusable(error) is unusable


def test_a_failed_prefill_frees_its_slot_and_the_next_request_takes_it(llm, monkeypatch):
    fail_prefill_of(monkeypatch, llm, BAD, torch.OutOfMemoryError(OOM))
    engine = llm.engine
    bad = llm.make_request(BAD, SamplingParams(max_tokens=8, temperature=1.0, seed=1))
    engine.add(bad)
    assert engine.step() == [(bad, "")]
    assert bad.finish_reason == "error" and bad.error == f"prefill failed: OutOfMemoryError: {OOM}"
    assert not llm.runner.state.active[bad.slot] and engine.stats().running == 0  # released
    assert not engine.has_work and engine.unusable is None
    good = llm.make_request(GOOD[0], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add(good)
    engine.step()
    assert good.slot == bad.slot and engine.scheduler.running == {good.slot: good}
    engine.cancel(good)


def test_generate_finishes_the_others_then_raises_with_every_completion(llm, monkeypatch):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = llm.generate(GOOD, params)
    fail_prefill_of(monkeypatch, llm, BAD, torch.OutOfMemoryError(OOM))
    message = f"1 of 3 requests failed; prefill failed: OutOfMemoryError: {OOM}"
    with pytest.raises(GenerationError, match=f"^{message}$") as caught:
        llm.generate([GOOD[0], BAD, GOOD[1]], params)
    first, failed, second = caught.value.completions
    assert failed.finish_reason == "error" and failed.token_ids == [] and "OutOfMemoryError" in failed.error
    assert [first.token_ids, second.token_ids] == [c.token_ids for c in alone]
    assert first.error is None and first.finish_reason == "length"
    llm.engine.step()  # an empty plan: the freed slots go back on the device too
    assert not llm.engine.has_work and not llm.runner.state.active.any()


def test_a_failed_stream_raises_after_its_pieces(llm, monkeypatch):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    [whole] = llm.generate([GOOD[0]], params)
    fail_decode(monkeypatch, llm, RuntimeError("injected"), at=1)
    stream, pieces = llm.stream(GOOD[0], params), []
    with pytest.raises(GenerationError, match="^decode step failed: RuntimeError: injected$"):
        for piece in stream:
            pieces.append(piece)
    failed = stream.completion
    assert failed.finish_reason == "error" and failed.token_ids == whole.token_ids[:2]  # prefill + 1 step
    assert "".join(pieces) == failed.text and whole.text.startswith(failed.text)
    assert list(llm.stream(GOOD[0], params)) and not llm.engine.has_work


def test_a_failed_decode_step_fails_the_requests_in_it(llm, monkeypatch):
    slots = llm.config.scheduler.slots
    prompts = [[5 + i, 6, 7] for i in range(slots + 1)]  # the last one waits for a slot
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [expected] = llm.generate([prompts[-1]], params)
    fail_decode(monkeypatch, llm, RuntimeError("injected decode failure"))
    with pytest.raises(GenerationError) as caught:
        llm.generate(prompts, params)
    completions = caught.value.completions
    assert [c.finish_reason for c in completions] == ["error"] * slots + ["length"]
    assert {c.error for c in completions[:slots]} == {
        "decode step failed: RuntimeError: injected decode failure"
    }
    assert completions[-1].token_ids == expected.token_ids
    assert llm.engine.unusable is None and not llm.engine.has_work


def test_a_device_unusable_error_fails_every_request_and_refuses_new_ones(model_dir, monkeypatch):
    llm = tiny_llm(model_dir, max_batch=2)
    fail_decode(monkeypatch, llm, torch.AcceleratorError(ILLEGAL))
    with pytest.raises(GenerationError) as caught:
        llm.generate([[5, 6], [7, 8], [9, 10]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [c.finish_reason for c in caught.value.completions] == ["error"] * 3  # the waiting one too
    assert all(ILLEGAL in c.error for c in caught.value.completions)
    assert llm.engine.unusable == f"decode step failed: AcceleratorError: {ILLEGAL}"
    with pytest.raises(DeviceUnusableError, match="illegal memory access"):
        llm.generate(GOOD[0], SamplingParams(max_tokens=4))


# ---- the live server ----


@pytest.fixture(scope="module")
def served(model_dir):
    server = Server(tiny_llm(model_dir), MODEL, max_queue=1)
    with live(server) as url:
        yield server, url


def sse_lines(http: httpx.Client, path: str, body: dict, headers: dict | None = None) -> list[str]:
    with http.stream("POST", path, json=body | {"stream": True}, headers=headers) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def test_server_fails_only_the_request_whose_prefill_raised(served, monkeypatch):
    server, url = served
    fail_prefill_of(monkeypatch, server.llm, BAD, torch.OutOfMemoryError(OOM))
    bad, good = {"model": MODEL, "prompt": BAD, "max_tokens": 8}, {"model": MODEL, "prompt": GOOD[0]}

    def error(request_id: str) -> dict:  # what failed and the request, not the exception's text (logged)
        message = f"prefill failed: out of memory (request id {request_id}; the server's log has the details)"
        return {"message": message, "type": "server_error", "param": None, "code": 500}

    with httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(2):  # max_queue is 1: a leaked queue place would make the second round a 429
            response = http.post("/v1/completions", json=bad)
            assert response.status_code == 500
            assert response.json()["error"] == error(response.headers["x-request-id"])

            *_, last_event, done = sse_lines(http, "/v1/completions", bad, {"x-request-id": "stream-1"})
            streamed = json.loads(last_event.removeprefix("data: "))
            assert streamed["error"] == error("stream-1") and done == "data: [DONE]"

            ok = http.post("/v1/completions", json=good | {"max_tokens": 4, "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert server.engine.queue_depth == 0 and server.engine.stats().running == 0
        assert 'redline_requests_total{outcome="error"} 4.0' in http.get("/metrics").text
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="prefill failed"):
        list(client.completions.create(model=MODEL, prompt=BAD, max_tokens=8, stream=True))
    assert client.completions.create(model=MODEL, prompt=GOOD[1], max_tokens=2).choices[0].text is not None


def test_templating_runs_off_the_event_loop(served, monkeypatch):
    """/health answers while a chat request's template is still rendering (here: held on an Event);
    were templating on the event loop, /health would wait for it and time out."""
    server, url = served
    tokenizer = server.llm.tokenizer
    render, entered, release = tokenizer.apply_chat_template, threading.Event(), threading.Event()

    def held(*args, **kwargs) -> str:
        entered.set()
        assert release.wait(60)
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", held)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    responses: list[httpx.Response] = []
    chat = threading.Thread(
        target=lambda: responses.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=60))
    )
    chat.start()
    try:
        assert entered.wait(30)
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    finally:
        release.set()
        chat.join(timeout=60)
    assert responses[0].status_code == 200


def test_a_chat_template_that_raises_is_a_400_naming_the_problem(model_dir, tmp_path):
    config_path = tmp_path / "tokenizer_config.json"
    for name in model_dir.iterdir():
        (tmp_path / name.name).symlink_to(name)
    config_path.unlink()
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config_path.write_text(json.dumps(config | {"chat_template": ALTERNATING}))
    server = Server(tiny_llm(tmp_path, max_batch=1), MODEL)
    user = {"role": "user", "content": "hi"}
    with live(server) as url, httpx.Client(base_url=url, timeout=60) as http:
        cases = [
            ([user, user], "Conversation roles must alternate"),
            ([{"role": "system", "content": "x"}, user], "TypeError"),
        ]
        for messages, problem in cases:
            response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "messages" and problem in error["message"], error
        ok = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [user], "max_tokens": 2})
        assert ok.status_code == 200


def test_health_is_503_once_the_engine_loop_dies_and_its_open_requests_fail(model_dir, monkeypatch):
    server = Server(tiny_llm(model_dir, max_batch=1), MODEL)
    body = {"model": MODEL, "prompt": GOOD[0], "max_tokens": 100, "ignore_eos": True}
    with live(server) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}

        def broken(value: float) -> None:  # the loop sets this gauge every turn: it dies once a slot is used
            if value:
                raise RuntimeError("injected")

        monkeypatch.setattr(server.metrics.slots_in_use, "set", broken)
        *_, last_event, done = sse_lines(http, "/v1/completions", body)
        died = "the engine loop died"  # the exception's text goes to the log only
        message = json.loads(last_event.removeprefix("data: "))["error"]["message"]
        assert message.startswith(f"{died} (request id req-") and "injected" not in message
        assert done == "data: [DONE]"
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "unhealthy",
            "error": {"message": f"the engine cannot serve: {died}", "type": "service_unavailable",
                      "param": None, "code": 503},
        }  # fmt: skip
        refused = http.post("/v1/completions", json=body)
        assert refused.status_code == 503 and refused.json()["error"] == health.json()["error"]
    assert not server.llm.engine.has_work and server.engine.queue_depth == 0


def test_health_is_503_after_the_engine_loop_stops(model_dir):
    server = Server(tiny_llm(model_dir, max_batch=1), MODEL)
    with live(server) as url:
        assert httpx.get(url + "/health").status_code == 200
        server.engine.stop()
        health = httpx.get(url + "/health")
        assert health.status_code == 503
        assert health.json()["error"]["message"] == "the engine cannot serve: the engine loop was stopped"
        refused = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": GOOD[0]})
        assert refused.status_code == 503


def test_health_is_503_after_a_device_unusable_error(model_dir, monkeypatch):
    server = Server(tiny_llm(model_dir, max_batch=1), MODEL)
    fail_decode(monkeypatch, server.llm, torch.AcceleratorError(ILLEGAL))
    with live(server) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        failed = http.post("/v1/completions", json={"model": MODEL, "prompt": GOOD[0], "max_tokens": 4})
        assert failed.status_code == 500
        assert failed.json()["error"]["message"].startswith("decode step failed (request id")
        health = http.get("/health")
        unusable = "the engine cannot serve: the device is unusable"
        assert health.status_code == 503 and health.json()["error"]["message"] == unusable
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": GOOD[0]})
        assert refused.status_code == 503 and refused.json()["error"]["message"] == unusable
        assert ILLEGAL not in failed.text + health.text + refused.text  # the log has it
        assert ILLEGAL in server.engine.problem()


@pytest.fixture()
def sigterm_restored():
    """`redline serve` installs a SIGTERM handler; the test process gets its own back."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def serve_args(model_dir: Path, port: int) -> list[str]:
    return ["serve", "--model", str(model_dir), *f"--port {port} --max-seq-len 128 --max-batch 1".split()]


def test_redline_serve_exits_1_when_the_engine_loop_dies(model_dir, monkeypatch, sigterm_restored):
    def broken(self, engine) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(Server, "_gauges", broken)  # the loop's per-turn callback: it dies on its first turn
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(serve_args(model_dir, port)) == 1


def test_redline_serve_exits_1_when_the_http_server_cannot_start(model_dir, sigterm_restored):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(serve_args(model_dir, taken.getsockname()[1])) == 1


def test_unexpected_errors_are_500_json_and_generation_errors_are_logged(served, monkeypatch, caplog):
    server, url = served

    def broken(prompt, params, group=None):
        raise KeyError("injected")

    monkeypatch.setattr(server.llm, "make_request", broken)
    monkeypatch.setattr(server.metrics, "registry", None)  # /metrics cannot render
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=60)
    assert response.status_code == 500
    request_id = response.headers["x-request-id"]
    assert response.json()["error"] == {
        "message": f"internal server error (request id {request_id}; the server's log has the details)",
        "type": "server_error", "param": None, "code": 500,
    }  # fmt: skip
    logged = [r for r in caplog.records if r.name == "redline.server" and r.exc_info]
    assert "injected" in str(logged[-1].exc_info[1])
    assert f"{request_id} (POST /v1/completions)" in logged[-1].getMessage()
    metrics = httpx.get(url + "/metrics")
    assert metrics.status_code == 500 and metrics.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": GOOD[0], "max_tokens": 2})
    assert ok.status_code == 200
