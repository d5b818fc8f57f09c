"""`redline` commands on a tiny saved checkpoint."""

from __future__ import annotations

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
    from redline.models.random_init import write_random_draft

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
    assert "num_draft_tokens must be in 1..8" in capsys.readouterr().err
