"""`redline eval`: scoring on the shipped task file (a right and a wrong answer of each kind) and an
end-to-end comparison table on the tiny trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redline.cli import main
from redline.dtypes import fast_dtype
from redline.evaluate.sandbox import run_python
from redline.evaluate.tasks import chosen_letter, final_answer, load_tasks, score

TASKS = Path(__file__).parent / "data" / "tasks.jsonl"

RIGHT_AND_WRONG = {
    "math-1": ("60 / 1.5 = 40, so the speed is \\boxed{40} km/h.", "The speed is 90 km/h."),
    "math-2": ("17 * 23 = 391 and 391 - 91 = 300", "17 * 23 - 91 = 301"),
    "choice-1": (" C. len", " B"),
    "choice-2": (" A", " (b) list"),
    "code-1": ("    return a + b\n", "    return a - b\n"),
    "code-2": ("```python\ndef is_even(n):\n    return n % 2 == 0\n```", "    while True:\n        pass\n"),
}


def test_shipped_tasks_score_right_and_wrong_answers():
    tasks = {t.id: t for t in load_tasks(TASKS)}
    assert {t.kind for t in tasks.values()} == {"math", "choice", "code"}
    for task_id, (right, wrong) in RIGHT_AND_WRONG.items():
        assert score(tasks[task_id], right), task_id
        assert not score(tasks[task_id], wrong), task_id


def test_answer_extraction():
    assert final_answer("so x = 3.50.") == "3.5"
    assert final_answer("total: 1,024 apples") == "1024"
    assert final_answer("\\boxed{x+1} and then 7") == "x+1"
    assert final_answer("no digits") is None
    assert chosen_letter("The answer is (d)") == "D" and chosen_letter("none") is None


def test_sandbox_contains_loops_allocations_and_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_python("import sys\nsys.exit(0)", timeout=30)
    assert not run_python("raise SystemExit(3)", timeout=30)
    assert not run_python("while True:\n    pass\n", timeout=1)  # killed at the timeout
    assert not run_python("x = bytearray(4 * 2**30)", timeout=30)  # over the address-space limit
    assert not run_python("open('big', 'wb').write(bytes(64 * 2**20))", timeout=30)  # over the file limit
    assert run_python("import os\nassert os.listdir('.') == ['program.py']", timeout=30)  # a fresh directory
    assert run_python("open('stray.txt', 'w').write('x')", timeout=30)
    assert not (tmp_path / "stray.txt").exists()  # it wrote into its own temporary directory
    assert run_python("import os\nassert 'HOME' not in os.environ", timeout=30)


def test_bad_task_file(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"problem": "1+1?"}\n')
    with pytest.raises(ValueError, match='needs an "answer"'):
        load_tasks(path)


def test_eval_compares_configurations(trained, tmp_path, capsys):
    out = tmp_path / "eval.json"
    argv = [
        "eval",
        "--model",
        str(trained / "target"),
        "--data",
        str(TASKS),
        "--dtype",
        "fp32",
        "--compare",
        "fp8",
    ]
    argv += ["--compare", f"spec:{trained / 'draft'}", "--windows", "2", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["config"] for r in rows] == ["fp32", "fp8", "fp32+eagle3"]
    base, fp8, spec = rows
    assert base["kl_to_base"] == 0 and base["greedy_agreement"] == 1.0
    assert spec["greedy_agreement"] == 1.0  # speculation is lossless
    assert 0 < fp8["kl_to_base"] < 0.05 and abs(fp8["perplexity"] / base["perplexity"] - 1) < 0.05
    assert set(base["accuracy"]) == {"math", "choice", "code"}
    assert "greedy = base" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["humaneval", "sharegpt"])
def test_eval_on_a_held_out_set(trained, tmp_path, name):
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(trained / "target"), "--data", name, "--limit", "2", "--dtype", "fp32"]
    argv += ["--compare", f"spec:{trained / 'draft'}", "--windows", "2", "--json", str(out)]
    assert main(argv) == 0
    base, spec = json.loads(out.read_text())
    assert spec["greedy_agreement"] == 1.0 and spec["kl_to_base"] < 1e-6
    assert 1 < base["perplexity"] < 384  # the tiny model's vocabulary: better than uniform
    if name == "humaneval":  # two problems, scored by running their tests: pass@1 is 0, 0.5 or 1
        assert base["accuracy"].keys() == {"humaneval pass@1"}
        assert base["accuracy"]["humaneval pass@1"] in (0.0, 0.5, 1.0)
    else:  # chat prompts: agreement only, no checkable answers
        assert base["accuracy"] == {}


def test_eval_hands_its_engine_flags_to_every_configuration(monkeypatch, capsys):
    """--tp and --enable-expert-parallel reach evaluate(); the base row is named as --compare names it."""
    from redline.evaluate import run as evaluation

    seen = {}

    def record(configs, tasks, texts, windows, **engine):
        seen.update(engine, names=[c.name for c in configs], dtypes=[c.dtype for c in configs])
        return []

    monkeypatch.setattr(evaluation, "evaluate", record)
    argv = [
        "eval",
        "--model",
        "m",
        "--data",
        "humaneval",
        "--limit",
        "1",
        "--tp",
        "2",
        "--enable-expert-parallel",
    ]
    assert main([*argv, "--compare", "fp8"]) == 0
    assert seen["tensor_parallel_size"] == 2 and seen["expert_parallel"] is True
    base = fast_dtype("cpu")  # no --dtype: bf16 where the CPU computes it natively (AVX-512 BF16), else fp32
    assert seen["names"] == [{"bfloat16": "bf16", "float32": "fp32"}[base], "fp8"]
    assert seen["dtypes"] == [base, "fp8"]
