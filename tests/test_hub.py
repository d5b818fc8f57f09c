"""Hugging Face Hub ids as models, offline: a cache laid out as huggingface_hub lays it out
(models--ORG--NAME/refs/REVISION -> snapshots/COMMIT/...) resolves to its snapshot for LLM, generate and
serve; a revision picks its own snapshot; an id not in the cache fails naming the cache and the offline
setting; nothing else that does not exist is taken for a hub id."""

from __future__ import annotations

import shutil

import pytest
from conftest import build_hf_model, llama3_hf_config, save_hf_model

from redline import LLM, SamplingParams
from redline.cli import main
from redline.models import hub
from redline.server.serve import served_name

REPO = "tiny-org/tiny-llama"


def _lay_out_cache(root, checkpoint, commit: str, revision: str = "main"):
    """The Hub cache's own layout for REPO at `commit`, with `revision` pointing at it."""
    repo = root / ("models--" + REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    shutil.copytree(checkpoint, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


@pytest.fixture()
def offline_cache(tmp_path, tokenizer_dir, monkeypatch):
    main_model = save_hf_model(build_hf_model(llama3_hf_config(), seed=1), tmp_path / "a", tokenizer_dir)
    other_model = save_hf_model(build_hf_model(llama3_hf_config(), seed=2), tmp_path / "b", tokenizer_dir)
    cache = tmp_path / "hub"
    snapshots = (
        _lay_out_cache(cache, main_model, "a" * 40),
        _lay_out_cache(cache, other_model, "b" * 40, revision="v2"),
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return main_model, other_model, snapshots


def test_a_hub_id_loads_its_cached_snapshot_at_a_revision(offline_cache):
    main_model, other_model, (main_snapshot, v2_snapshot) = offline_cache
    assert hub.resolve(REPO) == main_snapshot and hub.resolve(REPO, "v2") == v2_snapshot
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", compile=False, progress=False)
    for revision, local in ((None, main_model), ("v2", other_model)):
        from_hub = LLM(REPO, revision=revision, **kw)
        assert from_hub.model_dir == (main_snapshot if revision is None else v2_snapshot)
        want = LLM(local, **kw).generate([[5, 6, 7]], params)[0].token_ids
        assert from_hub.generate([[5, 6, 7]], params)[0].token_ids == want


def test_an_uncached_id_fails_naming_the_cache_and_the_offline_setting(offline_cache, capsys):
    with pytest.raises(
        FileNotFoundError,
        match=r"'tiny-org/absent' is not in the Hugging Face cache and HF_HUB_OFFLINE is set",
    ):
        LLM("tiny-org/absent", progress=False)
    with pytest.raises(FileNotFoundError, match=r"at revision 'v9' is not in the Hugging Face cache"):
        hub.resolve(REPO, "v9")
    for missing in ("./no-such-dir", "no-such-dir", "/abs/path/x"):
        with pytest.raises(FileNotFoundError, match="does not exist: give a checkpoint directory"):
            hub.resolve(missing)
    argv = ["generate", "--model", "tiny-org/absent", "--prompt", "x", "--no-compile"]
    assert main(argv) == 2 and "is not in the Hugging Face cache" in capsys.readouterr().err


def test_generate_takes_a_hub_id_and_serve_names_it_as_the_hub_does(offline_cache, capsys):
    argv = ["generate", "--model", REPO, "--revision", "v2", "--prompt", "x", "--dtype", "float32"]
    assert main([*argv, "--no-compile", "--max-tokens", "3"]) == 0
    assert served_name(REPO) == REPO
    assert served_name(str(offline_cache[0])) == "a"


def test_serve_takes_the_model_as_vllm_serve_does():
    from redline.cli import build_parser
    from redline.server.serve import engine_config

    parser = build_parser()
    config = engine_config(parser.parse_args(["serve", REPO, "--revision", "v2"]))
    assert (config.load.model, config.load.revision) == (REPO, "v2")
    assert engine_config(parser.parse_args(["serve", "--model", REPO])).load.model == REPO
    with pytest.raises(ValueError, match="no model given: redline serve MODEL"):
        engine_config(parser.parse_args(["serve"]))
    with pytest.raises(ValueError, match="two models given"):
        engine_config(parser.parse_args(["serve", REPO, "--model", "other/one"]))


def test_info_reads_a_hub_id(offline_cache, capsys):
    assert main(["info", "--model", REPO]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert main(["info", "--model", REPO, "--revision", "v2"]) == 0
    capsys.readouterr()
    assert main(["info", "--model", REPO, "--revision", "v9"]) == 2  # the revision reaches the resolver
    assert "at revision 'v9' is not in the Hugging Face cache" in capsys.readouterr().err
