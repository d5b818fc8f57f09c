"""What a probe of a live `redline serve` found, as tests (issue 30): bodies that gave 500s (integers of
5,000 digits, nesting 10,000 deep, lone surrogates), a web page's text/plain POST, foreign Host and
Origin headers, a trickled body and trickled headers; plus errors without internals, every answer
counted, and raw bodies fuzzed for 5xx."""

from __future__ import annotations

import json
import logging
import re
import select
import socket
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from live_server import live  # noqa: E402

from redline import LLM  # noqa: E402
from redline.failures import DeviceUnusableError  # noqa: E402
from redline.server.app import MAX_BODY_BYTES, Server  # noqa: E402
from redline.server.engine_loop import QueueFull  # noqa: E402
from redline.server.json_body import MAX_DEPTH, MAX_INTEGER_DIGITS  # noqa: E402

MODEL = "tiny"
READ_TIMEOUT_S = 1.0
HUGE = "9" * 5000  # over Python's 4,300-digit limit on int(str)
DEEP = "[" * 10_000 + "]" * 10_000
COMPLETION = '{"model": "tiny", "prompt": "hi", "max_tokens": 2, %s}'
CHAT = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, %s}'
TOKENIZE = '{"model": "tiny", "prompt": "hi", %s}'
DETOKENIZE = '{"model": "tiny", "tokens": [1, 2], %s}'
BODIES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/tokenize": TOKENIZE,
          "/detokenize": DETOKENIZE}  # fmt: skip
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tied_llama_dir) -> Server:
    llm = LLM(tied_llama_dir, dtype="float32", max_batch=4, max_seq_len=128)
    return Server(llm, MODEL, read_timeout_s=READ_TIMEOUT_S)


@pytest.fixture(scope="module")
def url(server) -> Iterator[str]:
    with live(server) as base:
        yield base


@pytest.fixture()
def http(url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=30) as client:
        yield client


def post(http: httpx.Client, path: str, body: str | bytes, **headers: str) -> httpx.Response:
    content = body.encode() if isinstance(body, str) else body
    return http.post(path, content=content, headers=JSON | headers)


def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["type"] and error["code"] == status, error
    for word in words:
        assert word in error["message"], error
    return error


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """A sample's value in /metrics (0 when absent): metric(http, "redline_rejections_total", reason="x")."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.compile(rf"^{name}\{{(.*)\}} (\S+)$" if labels else rf"^{name} (\S+)$", re.M)
    for match in pattern.finditer(http.get("/metrics").text):
        if not labels:
            return float(match.group(1))
        found = ",".join(sorted(match.group(1).split(",")))
        if found == wanted:
            return float(match.group(2))
    return 0.0


@pytest.mark.parametrize("path", BODIES)
def test_the_probes_500s_are_400s_naming_the_limit(http, path):
    """An integer of 5,000 digits (as a field, and as an unknown one), nesting 10,000 deep: each once a
    500 on these endpoints."""
    template = BODIES[path]
    before = metric(http, "redline_rejections_total", reason="bad_json")
    for extra in (f'"seed": {HUGE}', f'"unknown": {HUGE}', f'"unknown": -{HUGE}'):
        assert_error(post(http, path, template % extra), 400, f"more than {MAX_INTEGER_DIGITS} digits")
    for extra in (f'"unknown": {DEEP}', f'"unknown": {"{" * 5_000}'):
        assert_error(post(http, path, template % extra), 400)
    # the body's object is one level: MAX_DEPTH - 1 arrays inside it make MAX_DEPTH levels, one more is over
    deepest, over = ("[" * n + "]" * n for n in (MAX_DEPTH - 1, MAX_DEPTH))
    assert_error(post(http, path, template % f'"unknown": {over}'), 400, f"more than {MAX_DEPTH} deep")
    assert metric(http, "redline_rejections_total", reason="bad_json") == before + 6
    assert post(http, path, template % f'"unknown": {deepest}, "seed": {"9" * 18}').status_code == 200


def test_lone_surrogates_are_400s_naming_the_field(http):
    cases = [
        ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800abc"}', "prompt", "\\ud800"),
        ("/tokenize", '{"model": "tiny", "prompt": "ab\\udfff"}', "prompt", "\\udfff"),
        ("/v1/chat/completions", CHAT.replace('"hi"', '"\\udc00"') % '"n": 1', "messages[0].content", "dc00"),
        ("/v1/completions", COMPLETION % '"stop": ["ok", "\\ud83d"]', "stop[1]", "d83d"),
        ("/v1/completions", COMPLETION % '"\\ud800key": 1', "\\ud800key", "d800"),
    ]  # fmt: skip
    for path, body, field, code in cases:
        error = assert_error(post(http, path, body), 400, "lone surrogate", code)
        assert error["param"] == field, error
    pair = post(http, "/tokenize", '{"model": "tiny", "prompt": "\\ud83d\\ude00"}')  # a pair is one emoji
    assert pair.status_code == 200 and pair.json()["count"] > 0


def test_a_web_pages_text_plain_post_is_415_and_starts_nothing(http, server):
    generated = metric(http, "redline_requests_total", outcome="length")
    rejected = metric(http, "redline_rejections_total", reason="not_json")
    body = COMPLETION % '"ignore_eos": true'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x", ""):
        response = http.post("/v1/completions", content=body, headers={"content-type": content_type})
        assert_error(response, 415, "application/json")
    no_header = http.post("/tokenize", content=b'{"prompt": "hi"}')
    assert_error(no_header, 415)
    ok = post(http, "/v1/completions", body, **{"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    assert metric(http, "redline_requests_total", outcome="length") == generated + 1  # only the JSON one
    assert metric(http, "redline_rejections_total", reason="not_json") == rejected + 5


FOREIGN_HOSTS = ("evil.example", "evil.example:8000", "192.168.1.5", "localhost.evil.example", "0.0.0.0",
                 "127.0.0.1.evil.com", "localhost:80@evil.example", "[::1]evil", "localhost:",
                 "[::ffff:127.0.0.1]")  # fmt: skip
LOOPBACK_HOSTS = ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "app.localhost", "127.0.0.5",
                  "localhost.")  # fmt: skip


def test_host_names_parse_strictly():
    from redline.server.web_policy import WebPolicy, host_name

    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:80", "Example.COM", "[::1]evil", "a:b:c")] == [
        "127.0.0.1", "::1", "example.com", "", ""]  # fmt: skip
    loopback = WebPolicy.for_bind("127.0.0.1")
    assert not any(loopback.host_allowed(h) for h in FOREIGN_HOSTS)
    assert all(loopback.host_allowed(h) for h in LOOPBACK_HOSTS) and loopback.host_allowed(None)


def test_foreign_host_names_are_refused_on_loopback(http):
    before = metric(http, "redline_rejections_total", reason="host")
    for host in FOREIGN_HOSTS:
        assert_error(http.get("/v1/models", headers={"host": host}), 403, "Host", "--allowed-hosts")
    for host in LOOPBACK_HOSTS:
        assert http.get("/v1/models", headers={"host": host}).status_code == 200, host
    assert metric(http, "redline_rejections_total", reason="host") == before + len(FOREIGN_HOSTS)


def test_allowed_hosts_widen_the_loopback_default(server):
    from redline.server.web_policy import WebPolicy

    widened = Server(server.llm, MODEL, policy=WebPolicy.for_bind("127.0.0.1", ["llm.lan"]))
    with live(widened) as base, httpx.Client(base_url=base, timeout=30) as client:
        assert client.get("/v1/models", headers={"host": "llm.lan:8000"}).status_code == 200
        assert client.get("/v1/models", headers={"host": "evil.example"}).status_code == 403
    public = WebPolicy.for_bind("0.0.0.0")
    assert public.host_allowed("anything.example") and public.host_allowed("10.0.0.2:8000")
    listed = WebPolicy.for_bind("0.0.0.0", ["api.example.com"])
    assert listed.host_allowed("api.example.com:443") and not listed.host_allowed("evil.example")


def test_origins_are_refused_unless_listed_and_only_listed_ones_get_cors(http, server):
    body = COMPLETION % '"n": 1'
    page = {"origin": "https://evil.example"}
    assert_error(post(http, "/v1/completions", body, **page), 403, "Origin", "--allowed-origins")
    assert_error(http.get("/v1/models", headers=page), 403)
    preflight = http.options("/v1/completions", headers=page | {"access-control-request-method": "POST"})
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    from redline.server.web_policy import WebPolicy

    policy = WebPolicy.for_bind("127.0.0.1", origins=["http://localhost:3000"])
    with live(Server(server.llm, MODEL, policy=policy)) as base, httpx.Client(base_url=base) as client:
        app = {"origin": "http://localhost:3000"}
        asked = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}
        preflight = client.options("/v1/completions", headers=app | asked)
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        sdk = asked | {"access-control-request-headers": "content-type, authorization, x-stainless-os"}
        echoed = client.options("/v1/completions", headers=app | sdk).headers["access-control-allow-headers"]
        assert echoed == "content-type, authorization, x-stainless-os"  # the OpenAI JS SDK's own headers too
        assert client.options("/v1/completions", headers=app).status_code == 405  # no preflight: the API's
        answer = client.post("/v1/completions", content=body, headers=JSON | app, timeout=30)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == app["origin"]
        assert_error(client.get("/v1/models", headers=page), 403)
        no_origin = client.get("/v1/models")  # curl, SDKs: no Origin, no CORS headers
        assert no_origin.status_code == 200 and "access-control-allow-origin" not in no_origin.headers


def raw_exchange(url: str, chunks: list[bytes], gap_s: float, wait_s: float) -> tuple[bytes, float]:
    """Sends chunks gap_s apart over one raw connection, listening in the gaps (it stops sending once the
    server answers), then reads until the server closes the connection or wait_s pass; returns what came
    back and the seconds it all took."""
    host, port = url.removeprefix("http://").split(":")
    start, answer = time.monotonic(), b""
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        for chunk in chunks:
            sock.sendall(chunk)
            readable, _, _ = select.select([sock], [], [], gap_s)
            if readable:
                break
        while data := sock.recv(65536):
            answer += data
    return answer, time.monotonic() - start


def test_a_trickled_body_or_header_gets_a_408_within_the_read_timeout(http, url):
    before = metric(http, "redline_rejections_total", reason="read_timeout")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    body = (COMPLETION % '"n": 1').encode()
    trickled_body = [head + f"Content-Length: {len(body)}\r\n\r\n".encode()] + [bytes([b]) for b in body]
    answer, _ = raw_exchange(url, trickled_body, gap_s=0.2, wait_s=10)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request body not received within 1 s" in answer and b"connection: close" in answer.lower()
    trickled_headers = [b"POST /v1/completions HTTP/1.1\r\n"] + [b"X-Slow: %d\r\n" % i for i in range(40)]
    answer, took = raw_exchange(url, trickled_headers, gap_s=0.2, wait_s=10)
    assert answer.startswith(b"HTTP/1.1 408") and b"request headers not received within 1 s" in answer
    assert took < 40 * 0.2, took  # cut off, not served once the client finished
    silent, took = raw_exchange(url, [], gap_s=0, wait_s=10)  # a connection that sends nothing is closed
    assert silent == b"" and took < 5 * READ_TIMEOUT_S
    assert metric(http, "redline_rejections_total", reason="read_timeout") == before + 2
    assert http.get("/health").json() == {"status": "ok"}


def test_a_refused_body_cannot_hold_the_connection(url):
    """A 415 is answered before the body is read; trickling the rest of a 1 MB body after it does not keep
    the connection: it is closed once max(read timeout, keep-alive: 5 s) pass."""
    host, port = url.removeprefix("http://").split(":")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + b"Content-Length: 1000000\r\n\r\nx")
        assert sock.recv(65536).startswith(b"HTTP/1.1 415")
        start, closed = time.monotonic(), False
        while not closed and time.monotonic() - start < 20:
            try:
                sock.sendall(b"x")
                readable, _, _ = select.select([sock], [], [], 0.25)
                closed = bool(readable) and sock.recv(65536) == b""
            except OSError:  # reset: closed
                closed = True
    assert closed and time.monotonic() - start < 5 + 3, time.monotonic() - start


def test_a_client_leaving_mid_body_is_counted_as_499_not_a_failure(http, url, caplog):
    def count(status: str) -> float:
        return metric(http, "redline_http_requests_total", endpoint="/v1/completions", status=status)

    before = {status: count(status) for status in ("499", "500")}
    host, port = url.removeprefix("http://").split(":")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    with caplog.at_level(logging.ERROR, logger="redline.server"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head + b'Content-Length: 100\r\n\r\n{"model": ')
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while count("499") == before["499"] and time.monotonic() < deadline:
            time.sleep(0.1)
    assert count("499") == before["499"] + 1 and count("500") == before["500"]
    assert not [r for r in caplog.records if r.name == "redline.server"]  # nothing failed


def test_requests_http_cannot_parse_get_json_400s_and_are_counted(http, url):
    before = metric(http, "redline_rejections_total", reason="bad_http")
    for raw in (b"GET /health HTTP/1.1\r\n\r\n", b"GET /h\xffealth HTTP/1.1\r\nHost: x\r\n\r\n",
                b"NOT HTTP AT ALL\r\n\r\n"):  # fmt: skip
        answer, _ = raw_exchange(url, [raw], gap_s=0.5, wait_s=10)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, answer
        assert json.loads(body)["error"]["message"].startswith("malformed HTTP request")
    assert metric(http, "redline_rejections_total", reason="bad_http") == before + 3
    assert http.head("/health").status_code == 200  # load balancers' probe


def test_a_grammar_error_names_no_source_file(http):
    error = assert_error(post(http, "/v1/completions", COMPLETION % '"guided_regex": "(a"'), 400)
    assert "parenthesis" in error["message"] and ".cc:" not in error["message"], error


def test_a_5xx_names_the_request_and_nothing_internal(http, server, monkeypatch, caplog):
    secret = "/opt/build/torch/csrc/distributed 127.0.0.1:22700"

    def bug(*args, **kwargs):
        raise RuntimeError(secret)

    monkeypatch.setattr(server, "choices", bug)
    with caplog.at_level(logging.ERROR, logger="redline.server"):
        response = post(http, "/v1/completions", COMPLETION % '"n": 1')
        given = post(http, "/v1/completions", COMPLETION % '"n": 1', **{"x-request-id": "client-42"})
    error = assert_error(response, 500, "request id")
    request_id = response.headers["x-request-id"]
    assert request_id in error["message"] and error["type"] == "server_error"
    assert (
        "22700" not in response.text and "RuntimeError" not in response.text and "/opt" not in response.text
    )
    assert given.headers["x-request-id"] == "client-42" and "client-42" in given.json()["error"]["message"]
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None and secret in str(logged[0].exc_info[1])


def test_an_engine_failure_reaches_the_client_without_its_cause(http, server, monkeypatch, caplog):
    """The engine's message ("prefill failed: RuntimeError: <internals>") reaches the client as what
    failed and the request id, in a JSON answer and in a stream; the log has the whole message."""
    cause = "CUDA error at /usr/src/pytorch/c10/cuda/CUDAException.cpp:44 rank 1 127.0.0.1:22700"

    def add_failing(request):  # the engine loop delivers this request's failure at once
        raise DeviceUnusableError(f"prefill failed: RuntimeError: {cause}")

    monkeypatch.setattr(server.llm.engine, "add", add_failing)
    with caplog.at_level(logging.ERROR, logger="redline.server"):
        response = post(http, "/v1/completions", COMPLETION % '"n": 1')
        stream = post(http, "/v1/completions", COMPLETION % '"stream": true')
    error = assert_error(response, 500, "prefill failed", "request id")
    assert "22700" not in response.text and "RuntimeError" not in response.text
    events = [line.removeprefix("data: ") for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "prefill failed" in json.loads(events[-2])["error"]["message"]
    assert "22700" not in stream.text
    ids = [response.headers["x-request-id"], stream.headers["x-request-id"]]
    assert ids[0] in error["message"]
    for request_id in ids:
        assert any(request_id in r.getMessage() and cause in r.getMessage() for r in caplog.records)


def test_every_answer_is_counted_by_endpoint_status_and_reason(http, server, monkeypatch):
    def count(endpoint: str, status: int) -> float:
        return metric(http, "redline_http_requests_total", endpoint=endpoint, status=str(status))

    def reason(name: str) -> float:
        return metric(http, "redline_rejections_total", reason=name)

    before = {key: count(*key) for key in [("/v1/completions", s) for s in (200, 400, 429)] +
              [("/tokenize", 200), ("other", 404), ("/health", 200)]}  # fmt: skip
    reasons = {name: reason(name) for name in ("too_long", "bad_field", "queue_full", "not_found")}
    assert post(http, "/v1/completions", COMPLETION % '"n": 1').status_code == 200
    assert post(http, "/tokenize", TOKENIZE % '"add_special_tokens": true').status_code == 200
    assert post(http, "/v1/completions", COMPLETION % '"temperature": -1').status_code == 400
    too_long = {"model": MODEL, "prompt": "word " * 200, "max_tokens": 4}
    assert post(http, "/v1/completions", json.dumps(too_long)).status_code == 400
    assert http.get("/nowhere").status_code == 404
    assert http.get("/health").status_code == 200

    def full(*args, **kwargs):
        raise QueueFull

    monkeypatch.setattr(server.engine, "submit", full)
    assert post(http, "/v1/completions", COMPLETION % '"n": 1').status_code == 429
    monkeypatch.undo()
    after = {key: count(*key) for key in before}
    assert after[("/v1/completions", 200)] == before[("/v1/completions", 200)] + 1
    assert after[("/v1/completions", 400)] == before[("/v1/completions", 400)] + 2
    assert after[("/v1/completions", 429)] == before[("/v1/completions", 429)] + 1
    assert after[("/tokenize", 200)] == before[("/tokenize", 200)] + 1
    assert after[("other", 404)] == before[("other", 404)] + 1
    assert after[("/health", 200)] == before[("/health", 200)] + 1
    assert {name: reason(name) - reasons[name] for name in reasons} == {
        "too_long": 1, "bad_field": 1, "queue_full": 1, "not_found": 1}  # fmt: skip


def test_the_api_key_guards_every_path_but_health_and_metrics_can_take_its_own(server):
    keyed = Server(server.llm, MODEL, api_key="sk-main", metrics_api_key="sk-metrics")
    with live(keyed) as base, httpx.Client(base_url=base, timeout=30) as client:
        main, scrape = {"authorization": "Bearer sk-main"}, {"authorization": "Bearer sk-metrics"}
        for path in ("/v1/models", "/openapi.json", "/metrics", "/nowhere"):
            assert client.get(path).status_code == 401, path
        assert client.post("/tokenize", content=TOKENIZE % '"n": 1', headers=JSON).status_code == 401
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models", headers=main).status_code == 200
        assert client.get("/openapi.json", headers=main).status_code == 200
        assert client.get("/metrics", headers=scrape).status_code == 200
        assert client.get("/metrics", headers=main).status_code == 401  # its own key, once given
        assert client.get("/v1/models", headers=scrape).status_code == 401
        with httpx.Client(base_url=base, headers=scrape) as scraper:
            assert metric(scraper, "redline_rejections_total", reason="unauthorized") == 7
    behind_main = Server(server.llm, MODEL, api_key="sk-main")
    with live(behind_main) as base:
        assert httpx.get(base + "/metrics").status_code == 401
        assert httpx.get(base + "/metrics", headers={"authorization": "Bearer sk-main"}).status_code == 200


SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
).map(json.dumps)
SURROGATES = ['"\\ud800"', '"a\\udfffb"', '["\\udbff\\udbff"]', '"\\ud83d\\ude00"', '"\\u0000"']
FIELDS = ["unknown", "max_tokens", "prompt", "messages", "tokens", "seed", "stop", "n"]


def mutated_body(draw) -> tuple[str, bytes]:
    """A POST endpoint and a body: random bytes, or one of its bodies with a field holding a huge or
    negative integer literal, a deep nest, an escaped surrogate, or any JSON value."""
    path = draw(st.sampled_from(sorted(BODIES)))
    if draw(st.integers(0, 5)) == 0:
        return path, draw(st.binary(max_size=300))
    digits, depth = draw(st.integers(1, 6000)), draw(st.integers(1, 12_000))
    literals = ["9" * digits, "-" + "1" * digits, f"1e{digits}", f"0.{'5' * digits}",
                "[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth]  # fmt: skip
    value = draw(st.one_of(st.sampled_from(literals), st.sampled_from(SURROGATES), ANY_JSON))
    body = BODIES[path] % f'"{draw(st.sampled_from(FIELDS))}": {value}'
    if draw(st.booleans()):  # the whole body, or a body cut short
        return path, body.encode()
    return path, body[: draw(st.integers(0, 400))].encode()


@settings(max_examples=150, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(case=st.composite(mutated_body)())
def test_raw_bodies_never_get_a_5xx(http, case):
    path, body = case
    response = http.post(path, content=body, headers=JSON)
    assert response.status_code < 500, (path, body[:200], response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["code"], int)


def test_bodies_near_the_size_limit_are_read_whole(http, server):
    """Real-size bodies through the bounds' walk: 100,000 token ids (about 470 KB) and a prompt of about
    800 KB of text, each answered as the tokenizer answers it; one string more is a 413."""
    tokenizer, vocab = server.llm.tokenizer, server.llm.model_config.vocab_size
    ids = [(7 * i) % vocab for i in range(100_000)]
    body = json.dumps({"model": MODEL, "tokens": ids})
    assert 400_000 < len(body) < MAX_BODY_BYTES
    answer = post(http, "/detokenize", body)
    assert answer.status_code == 200 and answer.json()["prompt"] == tokenizer.decode(ids)
    text = " ".join(f"word{i % 977}" for i in range(100_000))
    answer = post(http, "/tokenize", json.dumps({"model": MODEL, "prompt": text}))
    assert answer.status_code == 200 and answer.json()["tokens"] == tokenizer.encode(text)
    assert post(http, "/tokenize", json.dumps({"prompt": text * 2})).status_code == 413
