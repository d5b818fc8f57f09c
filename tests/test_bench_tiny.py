"""`redline bench` on the tiny trained pair (the demo: test_demo.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from redline.benchmark import llamacpp
from redline.benchmark.contenders import LlamaCppContender, RedlineContender
from redline.benchmark.rounds import in_turns
from redline.benchmark.run import BenchSettings, contenders_of, redline_rows, speculation_of
from redline.cli import main
from redline.train.draft import held_out_prompts


def test_bench_writes_json_and_plot(trained, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = [
        "bench", "--model", str(trained / "target"), "--draft", str(trained / "draft"),
        "--num-draft-tokens", "1,3", "--max-tokens", "16", "--prompts", "2", "--prompt-len", "16",
        "--repeats", "1", "--modes", "eager", "--json", str(out), "--plot", str(png), "--tree", "2,3",
        "--tree", "4,8",
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert {"cpu", "threads", "torch"} <= result["machine"].keys()
    runs = result["runs"]
    assert [(r["engine"], r["num_draft_tokens"]) for r in runs] == [
        ("hf", None), ("redline", None),
        ("redline+eagle3", 1), ("redline+eagle3 tree 2x3", 1), ("redline+eagle3 tree 4x5", 1),  # 4x8 at K 1
        ("redline+eagle3", 3), ("redline+eagle3 tree 2x3", 3), ("redline+eagle3 tree 4x8", 3),
    ]  # fmt: skip
    assert result["settings"]["in_turns"]  # the tiny engines fit in memory together
    plain = runs[1]
    for r in runs:
        assert len(r["rates"]) == 2  # 2 prompts x 1 repeat, in the order they ran
        assert 0 < r["tps_user_min"] <= r["tps_user_median"] <= r["tps_user_max"]
        expected = sorted(a / b for a, b in zip(r["rates"], plain["rates"], strict=True))
        assert r["x_plain"] == pytest.approx(sum(expected) / 2)  # the median of 2 paired ratios
        over_hf = [a / b for a, b in zip(r["rates"], runs[0]["rates"], strict=True)]
        assert r["x_hf"] == pytest.approx(sum(over_hf) / 2)
        assert r["ttft_s_median"] > 0
        assert r["tokens_equal_plain"]  # greedy: speculation is lossless
        if r["engine"].startswith("redline+eagle3"):
            k = r["num_draft_tokens"]
            assert 1.0 <= r["acceptance_length"] <= k + 1
            assert len(r["acceptance_rates"]) == k
            assert 0.0 < r["draft_share"] < 1.0
        else:
            assert r["acceptance_length"] is None and r["draft_share"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_runs_redlines_rows_again_in_each_quantization(trained, tmp_path):
    """--quantization int8,int4: the plain and EAGLE-3 rows in the model's dtype, then in int8 and int4, each
    quantized row with its own roofline (fewer bytes than the unquantized model's) and greedy tokens equal
    to its own quantization's plain row; x plain against the unquantized plain row."""
    out = tmp_path / "bench.json"
    argv = [
        "bench", "--model", str(trained / "target"), "--draft", str(trained / "draft"), "--num-draft-tokens",
        "2", "--max-tokens", "12", "--prompts", "2", "--prompt-len", "16", "--repeats", "1", "--modes",
        "eager", "--no-hf", "--quantization", "int8,int4", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [r["engine"] for r in runs] == [
        "redline", "redline+eagle3", "redline int8", "redline+eagle3 int8", "redline int4",
        "redline+eagle3 int4",
    ]  # fmt: skip
    assert all(r["tokens_equal_plain"] for r in runs)
    full = result["roofline"]["weight_bytes"]
    assert full > runs[2]["weight_bytes"] > runs[4]["weight_bytes"] and runs[2]["quantization"] == "int8"
    assert main(["bench", "--model", str(trained / "target"), "--quantization", "int3"]) == 2


def test_bench_rows_put_lookup_beside_the_chain_and_every_tree():
    settings = BenchSettings(ngram=(2, 4), trees=((4, 8),))
    rows = redline_rows(Path("d"), [1, 3], settings)
    names = [(speculation_of(draft, lookup, tree)[0] if k else "redline", k) for k, draft, lookup, tree
             in rows]  # fmt: skip
    assert names == [
        ("redline", 0),
        ("redline+eagle3", 1), ("redline+eagle3 tree 4x5", 1), ("redline+ngram", 1),
        ("redline+eagle3+ngram", 1), ("redline+eagle3+ngram tree 4x5", 1),
        ("redline+eagle3", 3), ("redline+eagle3 tree 4x8", 3), ("redline+ngram", 3),
        ("redline+eagle3+ngram", 3), ("redline+eagle3+ngram tree 4x8", 3),
    ]  # fmt: skip
    _, options = speculation_of(Path("d"), (2, 4), (4, 8))
    assert options == {"draft": Path("d"), "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8,
                       "prompt_lookup_min": 2, "prompt_lookup_max": 4}  # fmt: skip


def test_bench_rejects_bad_draft_lengths(trained, capsys):
    assert main(["bench", "--model", str(trained / "target"), "--num-draft-tokens", "0,3"]) == 2
    assert "1..8" in capsys.readouterr().err


class Recorded(RedlineContender):
    """A real redline engine that writes down which prompts it completed, in order."""

    def __init__(self, *args, log: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def complete(self, prompt, n):
        self.log.append((self.engine, tuple(prompt)))
        return super().complete(prompt, n)


@pytest.mark.parametrize("together", [True, False])
def test_engines_take_turns_prompt_by_prompt_or_run_apart(trained, together):
    target = trained / "target"
    prompts = held_out_prompts(target, 2, 12)
    settings = BenchSettings(max_tokens=6, num_prompts=2, prompt_len=12, repeats=2, modes=(False,), hf=False)
    log: list = []
    contenders = [
        Recorded(c.model_dir, c.engine, c.num_draft_tokens, c.compiled, c.options, log=log)
        for c in contenders_of(target, trained / "draft", [2], prompts, settings)
    ]
    assert [c.engine for c in contenders] == ["redline", "redline+eagle3"]
    measured, failures = in_turns(contenders, prompts, 6, 2, together)
    assert not failures
    p0, p1 = map(tuple, prompts)
    assert p0 != p1
    warm = [("redline", p0), ("redline+eagle3", p0)]  # each engine's warm-up completion
    if together:  # after both warm-ups: A p0, B p0, A p1, B p1, then B first: B p0, A p0, B p1, A p1
        a, b = "redline", "redline+eagle3"
        assert log == [*warm, (a, p0), (b, p0), (a, p1), (b, p1), (b, p0), (a, p0), (b, p1), (a, p1)]
    else:  # A warm, A p0 p1 p0 p1, then B's
        apart = [(e, p) for e in ("redline", "redline+eagle3") for p in (p0, p0, p1, p0, p1)]
        assert log == apart
    for m in measured:
        assert len(m.runs) == 4 and all(len(r.tokens) == 6 for r in m.runs)
        assert m.contender.llm is None  # closed
    assert [r.tokens for r in measured[0].runs] == [r.tokens for r in measured[1].runs]  # greedy, lossless
    assert measured[1].row["acceptance_length"] >= 1.0


FAKE_CHILD = """
import json, os, signal, sys
sys.stdin.readline()
print(json.dumps({"ready": True}), flush=True)
for i, line in enumerate(sys.stdin):
    if i == CRASH_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    reply = {"tokens": [1] * json.loads(line)["n"], "ttft_s": 0.1, "rate": 9.0}
    print(ANSWER if ANSWER else json.dumps(reply), flush=True)
"""


class FakeLlamaCpp(LlamaCppContender):
    """The llama.cpp row's protocol, spoken by a script in place of llama.cpp: it answers, then is killed
    at its CRASH_AT-th completion (or answers ANSWER)."""

    def __init__(self, script: Path):
        super().__init__(script, 64, 1, engine="llama.cpp fake")
        self.script = script

    def open(self) -> None:
        self.child = llamacpp.Child(self.path, self.context, self.threads, [sys.executable, str(self.script)])


def fake_child(tmp_path: Path, crash_at: int, answer: str = "") -> Path:
    script = tmp_path / f"child_{crash_at}.py"
    script.write_text(FAKE_CHILD.replace("CRASH_AT", str(crash_at)).replace("ANSWER", repr(answer)))
    return script


def test_a_llama_cpp_child_killed_mid_run_costs_its_row_not_the_bench(trained, tmp_path):
    """Killed at its third completion (the warm-up and round 1's first prompt answered): the failure names
    the file and the signal, its row is dropped, redline's keeps all its completions, every child ends."""
    target = trained / "target"
    prompts = held_out_prompts(target, 2, 8)
    settings = BenchSettings(max_tokens=4, num_prompts=2, prompt_len=8, repeats=2, modes=(False,), hf=False)
    fake = FakeLlamaCpp(fake_child(tmp_path, crash_at=2))
    contenders = [fake, *contenders_of(target, None, [], prompts, settings)]
    measured, failures = in_turns(contenders, prompts, 4, 2, together=True)
    assert [m.contender.engine for m in measured] == ["redline"] and len(measured[0].runs) == 4
    assert len(failures) == 1 and "child_2.py" in failures[0] and "signal 9" in failures[0]
    assert fake.child is None


def test_a_llama_cpp_child_that_stops_answering_is_killed_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "ANSWER_S", 0.5)
    monkeypatch.setattr(llamacpp, "WAIT_S", 0.5)  # then killed: it ignores its stdin closing
    script = tmp_path / "silent.py"
    script.write_text("import time\ntime.sleep(60)\n")
    start = time.perf_counter()
    with pytest.raises(llamacpp.LlamaCppFailed, match="no answer within 0.5 s"):
        llamacpp.Child(tmp_path, 64, 1, [sys.executable, str(script)])
    assert time.perf_counter() - start < 30


def test_a_llama_cpp_child_that_answers_nonsense_fails_by_name(tmp_path):
    with pytest.raises(llamacpp.LlamaCppFailed, match="answered 'hello'"):
        child = llamacpp.Child(tmp_path, 64, 1, [sys.executable, str(fake_child(tmp_path, 99, "hello"))])
        child.complete([1, 2, 3], 4)


def test_a_llama_cpp_file_that_fails_costs_its_row_not_the_bench(trained, tmp_path):
    """A file llama.cpp cannot load (here: not a GGUF at all) is reported by name; the rest runs."""
    target = trained / "target"
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(llamacpp.LlamaCppFailed, match="broken.gguf"):
        llamacpp.Child(broken, 64, 1)
    prompts = held_out_prompts(target, 1, 8)
    settings = BenchSettings(max_tokens=4, num_prompts=1, prompt_len=8, repeats=1, modes=(False,), hf=False)
    contenders = contenders_of(target, None, [], prompts, settings)
    contenders.insert(0, LlamaCppContender(broken, 64, 1, engine="llama.cpp broken"))
    measured, failures = in_turns(contenders, prompts, 4, 1, together=True)
    assert [m.contender.engine for m in measured] == ["redline"]
    assert len(failures) == 1 and "broken.gguf" in failures[0]
