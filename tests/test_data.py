"""The built-in data sets, read from the installed packages: ShareGPT's cleaning and fixed held-out
split, HumanEval's problems scored by real execution, and `--data` resolution."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from redline.data import humaneval, sharegpt
from redline.data.sources import resolve
from redline.evaluate.public_sets import humaneval_tasks
from redline.evaluate.tasks import score


def test_sharegpt_split_sizes_and_no_overlap():
    train, held_out = sharegpt.conversations("train"), sharegpt.conversations("held_out")
    assert (len(train), len(held_out)) == (16_929, 461)
    assert not {c.id for c in train} & {c.id for c in held_out}
    # pieces of one chat ("<root>_0", "<root>_1", ...) never straddle the split
    assert not {sharegpt.root_id(c.id) for c in train} & {sharegpt.root_id(c.id) for c in held_out}
    assert all(sharegpt.is_held_out(c.id) for c in held_out)
    assert [c.id for c in held_out] == sorted(c.id for c in held_out)


def test_sharegpt_split_ignores_file_order():
    held_out, train = sharegpt.conversations("held_out"), sharegpt.conversations("train")
    shuffled = held_out + train[:2000]
    random.Random(0).shuffle(shuffled)
    again = sharegpt.partition(shuffled)
    assert list(again["held_out"]) == held_out and list(again["train"]) == train[:2000]


def test_sharegpt_cleaned_roles_alternate():
    for c in sharegpt.conversations("held_out") + sharegpt.conversations("train"):
        roles = [m["role"] for m in c.messages]
        assert len(roles) >= 2 and roles[0] == "user", c.id
        assert all(a != b for a, b in itertools.pairwise(roles)), c.id
        assert set(roles) <= {"user", "assistant"}, c.id
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in c.messages), c.id


def test_sharegpt_cleaning_rules():
    record = {
        "id": "abc_1",
        "conversations": [
            {"from": "system", "value": "*This conversation is shared from ChatHub*"},
            {"from": "gpt", "value": "a continuation of the previous piece"},
            {"from": "human", "value": "first"},
            {"from": "user", "value": "second"},
            {"from": "gpt", "value": "   "},
            {"from": "bard", "value": "answer"},
            {"from": "narrator", "value": "dropped"},
            {"from": "human", "value": ["not", "text"]},
        ],
    }
    assert sharegpt.clean(record) == sharegpt.Conversation(
        "abc_1",
        ({"role": "user", "content": "first\n\nsecond"}, {"role": "assistant", "content": "answer"}),
    )
    assert sharegpt.clean({"id": "x_0", "conversations": []}) is None
    assert sharegpt.clean({"id": "x_0", "conversations": [{"from": "gpt", "value": "only"}]}) is None
    assert sharegpt.clean({"id": "x_0", "conversations": [{"from": "human", "value": "q"}]}) is None


def test_sharegpt_reader_keeps_complete_records_of_a_cut_file(tmp_path):
    records = [{"id": f"r_{i}", "conversations": []} for i in range(3)]
    text = json.dumps(records, indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"r_2"') + 3])
    assert sharegpt.read_records(cut) == records[:2]
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert sharegpt.read_records(whole) == records
    broken = tmp_path / "broken.json"
    broken.write_text(text.replace('"r_1"', "r_1"))
    with pytest.raises(ValueError, match="not valid JSON"):
        sharegpt.read_records(broken)


def test_sharegpt_bad_split_name():
    with pytest.raises(ValueError, match='"train" or "held_out"'):
        sharegpt.conversations("test")  # type: ignore[arg-type]


def test_humaneval_problems():
    problems = humaneval.problems()
    assert len(problems) == 164 and len({p.task_id for p in problems}) == 164
    assert problems[0].task_id == "HumanEval/0" and problems[0].entry_point == "has_close_elements"
    assert all(f"def {p.entry_point}" in p.prompt for p in problems)


def test_every_canonical_solution_passes_its_tests():
    tasks = humaneval_tasks()
    failed = [
        t.id for t, p in zip(tasks, humaneval.problems(), strict=True) if not score(t, p.canonical_solution)
    ]
    assert failed == []


def test_wrong_completions_fail():
    task = humaneval_tasks()[0]  # has_close_elements
    assert not score(task, "    return False\n")
    assert not score(task, "    return True\n")
    assert not score(task, "    return (\n")  # a syntax error
    assert score(task, "    return any(abs(a - b) < threshold for i, a in enumerate(numbers)"
                       " for b in numbers[i + 1:])\n")  # fmt: skip


def test_resolve_data_values(tmp_path):
    assert resolve("sharegpt") == "sharegpt" and resolve("humaneval") == "humaneval"
    assert resolve(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="neither a data set"):
        resolve(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="never used for training"):
        resolve("humaneval", training=True)
    assert resolve("sharegpt", training=True) == "sharegpt"
