"""Properties of streamed text (Hypothesis): the incremental detokenizer never emits half a UTF-8
character and its pieces join to the whole decode; the stop-string matcher emits nothing past a stop
string; a request's streamed pieces join to its final text, cut where the non-streamed text is cut."""

from __future__ import annotations

import pytest
from conftest import VOCAB
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redline.engine.request import Request
from redline.sampling import SamplingParams
from redline.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

TEXT = st.text(alphabet="ab é€\n", max_size=40)  # 1-, 2- and 3-byte UTF-8 characters
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


def _cuts(text: str, cuts: list[int]) -> list[str]:
    """text split at the given offsets: "abcd", [3, 1] -> ["a", "bc", "d"]."""
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@SETTINGS
@given(text=TEXT, stops=st.lists(st.text(alphabet="ab é€\n", min_size=1, max_size=3), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))  # fmt: skip
def test_nothing_past_a_stop_string_is_emitted(text, stops, cuts):
    """Streamed as vLLM and the non-streamed path do: a stop string ends the text as soon as the text
    received contains it, cut where it starts; held-back text that might begin one is released at the
    end."""
    matcher = StopStringMatcher(stops)
    emitted, stopped = "", False
    for piece in _cuts(text, cuts):
        out, stopped = matcher.feed(piece)
        emitted += out
        if stopped:
            break
    if not stopped:
        emitted += matcher.flush()
    # what arrived by the piece in which a stop string first appears, cut where the first one starts
    arrived, want = "", text
    for piece in _cuts(text, cuts):
        arrived += piece
        hits = [i for i in (arrived.find(s) for s in stops) if i >= 0]
        if hits:
            want = arrived[: min(hits)]
            break
    assert emitted == want and stopped == any(s in text for s in stops)
    assert not any(s in emitted for s in stops) and text.startswith(emitted)


@SETTINGS
@given(data=st.data())
def test_detokenized_pieces_are_whole_characters_and_join_to_the_decode(tokenizer, data):
    ids = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(t) for t in ids]
    final = detok.flush()
    assert all(not p.endswith("\ufffd") for p in pieces)  # never half a character before the end
    assert "".join(pieces) + final == tokenizer.decode(ids)


@SETTINGS
@given(text=TEXT, stop=st.text(alphabet="ab é€", min_size=1, max_size=2), max_tokens=st.integers(1, 60))
def test_streamed_pieces_join_to_the_text_cut_at_the_stop(tokenizer, text, stop, max_tokens):
    ids = tokenizer.encode(text, add_special_tokens=False) or [
        tokenizer.encode("a", add_special_tokens=False)[0]
    ]
    params = SamplingParams(max_tokens=max_tokens, stop=[stop], ignore_eos=True)
    request = Request([5], params, tokenizer, frozenset())
    streamed = ""
    for token in ids:
        streamed += request.accept([token])
        if request.finished:
            break
    assert streamed == request.text
    full = tokenizer.decode(request.output_ids)
    cut = full.find(stop)
    if request.finish_reason == "stop":
        assert cut >= 0 and request.text == full[:cut]
    else:
        assert stop not in request.text and full.startswith(request.text)
