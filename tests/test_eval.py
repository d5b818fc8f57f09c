"""`redline eval`: scoring on the shipped task file (a right and a wrong answer of each kind) and an
end-to-end comparison table on the tiny trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redline.cli import main
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
