"""200 JSON schemas drawn by Hypothesis (objects of strings, integers, numbers, booleans, enums, arrays
and nested objects, some properties required): every output of the tiny trained model under each schema
validates against it (jsonschema) and ends with finish_reason "stop", greedy and sampled, with and
without EAGLE-3; greedy output is the same with and without it. Bounds (maxLength, min/max, maxItems)
keep every value finite: a model that knows nothing of the schema still has to finish it."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from redline import LLM, SamplingParams, StructuredOutputs

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = 200
NAMES = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


def scalars() -> st.SearchStrategy[dict]:
    low = st.integers(-1000, 1000)
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 10)),
        st.builds(lambda a, b: {"type": "integer", "minimum": min(a, b), "maximum": max(a, b)}, low, low),
        st.builds(lambda a: {"type": "number", "minimum": a, "maximum": a + 100}, low),
        st.just({"type": "boolean"}),
        st.builds(
            lambda values: {"enum": values},
            st.lists(st.text("xyz ", max_size=5), min_size=1, max_size=4, unique=True),
        ),
    )


def objects(values: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def build(properties: dict[str, dict], required: list[bool]) -> dict:
        names = [n for n, keep in zip(properties, required, strict=False) if keep]
        return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}

    props = st.dictionaries(NAMES, values, min_size=1, max_size=4)
    return props.flatmap(lambda p: st.builds(build, st.just(p), st.lists(st.booleans(), min_size=len(p),
                                                                          max_size=len(p))))  # fmt: skip


def schemas() -> st.SearchStrategy[dict]:
    inner = st.one_of(scalars(), st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n},
                                           scalars(), st.integers(0, 3)))  # fmt: skip
    return objects(st.one_of(inner, objects(inner)))


@pytest.fixture(scope="module")
def engines(trained):
    kw = dict(dtype="float32", max_batch=16, max_seq_len=512, progress=False)
    return LLM(trained / "target", **kw), LLM(trained / "target", draft=trained / "draft", **kw)


def drawn_schemas() -> list[dict]:
    """SCHEMAS examples of schemas() (Hypothesis' first is its simplest; the rest vary), the same every run
    (derandomized): drawn first, then run through the engines in one batch."""
    drawn: list[dict] = []

    @settings(max_examples=SCHEMAS, deadline=None, database=None, phases=[Phase.generate], derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(schemas())
    def draw(schema: dict) -> None:
        drawn.append(schema)

    draw()
    return drawn


def test_every_output_validates_against_its_schema(engines):
    drawn = drawn_schemas()
    assert len({json.dumps(s) for s in drawn}) > SCHEMAS * 0.9, "the schemas must vary"
    plain, eagle = engines
    prompt = plain.tokenizer.encode("Answer in JSON: ")
    greedy = {}
    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(
                max_tokens=400, temperature=temperature, seed=i, structured=StructuredOutputs(json=s)
            )
            for i, s in enumerate(drawn)
        ]
        for name, llm in (("plain", plain), ("eagle3", eagle)):
            out = llm.generate([prompt] * SCHEMAS, params)
            for schema, completion in zip(drawn, out, strict=True):
                assert completion.finish_reason == "stop", (schema, completion.text)
                jsonschema.validate(json.loads(completion.text), schema)
            if temperature == 0:
                greedy[name] = [c.token_ids for c in out]
    differ = [s for s, a, b in zip(drawn, greedy["plain"], greedy["eagle3"], strict=True) if a != b]
    assert not differ, f"greedy output differs with EAGLE-3 under {len(differ)} schemas: {differ[:2]}"
