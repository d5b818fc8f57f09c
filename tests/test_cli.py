"""`redline` commands on a tiny saved checkpoint."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from redline.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["init-random", "--out", str(out), "--vocab-size", "300"]) == 0
    return out


def test_generate_prints_text_and_a_summary(model_dir, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "def main():",
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--dtype",
            "float32",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and out.strip()
    assert "prompt tokens:" in err and "generated tokens: 12" in err and "tokens/s per user" in err
    assert "time to first token" in err


def test_generate_chat_with_sampling(model_dir, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--chat",
            "hi",
            "--max-tokens",
            "5",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--seed",
            "3",
            "--ignore-eos",
        ]
    )
    assert code == 0 and "generated tokens: 5" in capsys.readouterr().err


def test_info_prints_architecture_and_layer_pattern(model_dir, capsys):
    assert main(["info", "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "layers: 0:rope+dense 1:rope+dense" in out


def test_errors_are_one_clear_line(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    assert main(["info", "--model", str(tmp_path)]) == 2
    assert "unsupported architecture" in capsys.readouterr().err


def test_console_script_runs(model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "redline.cli", "info", "--model", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "architecture" in result.stdout


def test_generate_with_a_draft_prints_acceptance(model_dir, tmp_path, capsys):
    from redline.train.random_init import write_random_draft

    draft = write_random_draft(model_dir, tmp_path / "draft", draft_vocab=100)
    code = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "import os",
            "--max-tokens",
            "9",
            "--ignore-eos",
            "--draft",
            str(draft),
            "--num-draft-tokens",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0 and "generated tokens: 9" in err and "acceptance length:" in err
    assert (
        main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--prompt",
                "x",
                "--draft",
                str(draft),
                "--num-draft-tokens",
                "9",
            ]
        )
        == 2
    )
    assert "num_speculative_tokens must be an integer in 1..8, got 9" in capsys.readouterr().err


def test_bench_takes_prompts_from_a_held_out_set(model_dir, tmp_path):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(model_dir), "--data", "humaneval", "--prompts", "2", "--max-tokens", "4"]
    assert main([*argv, "--repeats", "1", "--no-hf", "--modes", "eager", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["data"] == "humaneval"
    assert [r["engine"] for r in result["runs"]] == ["redline"]


def test_data_flags_refuse_misuse(model_dir, tmp_path, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a port nobody listens on
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    model, out = str(model_dir), str(tmp_path / "d")
    cases = [
        ("bench --model M --dataset sharegpt", 2, "go with --url"),
        ("bench --url U --request-rate 2", 2, "add --dataset sharegpt"),
        ("bench --url U --dataset sharegpt", 2, "needs --tokenizer DIR"),
        ("bench --url U --dataset sharegpt --tokenizer M", 1, "cannot list the models"),
        ("eval --model M --data missing.jsonl", 2, "neither a data set"),
        ("eval --model M --data humaneval --limit 0", 2, "--limit must be"),
        ("train-draft --target M --out D --data humaneval", 2, "never used for training"),
        ("bench --model M --modes eager,fast", 2, "--modes takes eager and/or compiled"),
    ]
    names = {"M": model, "U": url, "D": out}
    for line, code, message in cases:
        assert main([names.get(word, word) for word in line.split()]) == code, line
        assert message in capsys.readouterr().err, line
    sock.close()
    with pytest.raises(SystemExit):
        main(["bench", "--model", model, "--data", "mmlu"])
