"""`redline bench` on the tiny trained pair (the demo: test_demo.py)."""

from __future__ import annotations

import json

from redline.cli import main


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
    for r in runs:
        assert 0 < r["tps_user_min"] <= r["tps_user_median"] <= r["tps_user_max"]
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


def test_bench_rejects_bad_draft_lengths(trained, capsys):
    assert main(["bench", "--model", str(trained / "target"), "--num-draft-tokens", "0,3"]) == 2
    assert "1..8" in capsys.readouterr().err
