"""The engine's CUDA path (Triton kernels selected as for a GPU) on fake CUDA tensors, on a CPU-only torch.

Target and draft are built on the meta device and placed on fake cuda:0 (tests/fake_cuda.py): prefill
(a 4,000-token prompt and short ones) and the decode step (K = 0 and 3, greedy and sampling, batch 1
and 4) run through the runner's device stages (runner/prefill.py, the step) with every kernel registered
as a torch.library.triton_op, chosen as on a GPU (layers/backends.py). What fails
here fails on a GPU too: a CPU tensor meeting a CUDA one, a host sync inside the step, a kernel wrapper
that does not trace, a kernel that does not compile for sm_90 or needs more shared memory than an H200
has. Numerics are not checked here (fake tensors hold no values): tests/test_kernels.py does that.

Under TRITON_INTERPRET=1 (conftest sets it on CPU) kernels are InterpretedFunctions, which run eagerly
only, so the tests run in a child pytest process with TRITON_INTERPRET=0 (the first test below).
Fake tensors run under no_grad, not inference_mode: under inference_mode FakeTensorMode constant-folds
one-element tensors for real, on the CUDA device a CPU-only build lacks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_cuda import (
    CUDA,
    H200_SHARED_MEMORY,
    OpLog,
    compile_for_h200,
    interpreted,
    recorded_launches,
    register_cuda_device_guard,
    resource_usage,
    use_h200_target,
)
from torch._subclasses.fake_tensor import FakeTensorMode

from redline.config import ModelConfig
from redline.draft_tree import TreeShape
from redline.kernels.attention_core import STEP_QUERIES
from redline.layers.backends import Backends
from redline.layers.input_order import InputOrdered
from redline.logprobs import width
from redline.models.eagle3 import Eagle3Draft, default_aux_layers, draft_config_for
from redline.models.llama import LlamaForCausalLM
from redline.models.quantize import WeightOnly, decoder_targets
from redline.quant.scheme import Fp8Scheme
from redline.runner.model_runner import ModelRunner
from redline.runner.plan import (
    PrefillBatch,
    PrefillChunk,
    Shapes,
    SlotSampling,
    SlotSetup,
    StepPlan,
    TableUpdate,
)
from redline.sampling import SamplingParams

pytest.importorskip("triton")
in_child = pytest.mark.skipif(interpreted(), reason="runs in test_fake_cuda_in_a_child_process")

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}  # fmt: skip
LLAMA3 = dict(
    architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=112,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
    rope_theta=500000.0, rope_scaling=ROPE,
)  # fmt: skip
LLAMA4 = dict(  # MoE with 16 experts: a batch-4, K = 3 step (16 tokens) takes the top-1 kernel
    architectures=["Llama4ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=48,
    intermediate_size_mlp=112, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=2,
    attention_chunk_size=1024, use_qk_norm=True, attn_temperature_tuning=4, floor_scale=8192,
    attn_scale=0.1, max_position_embeddings=8192, rope_theta=500000.0, rope_scaling=ROPE,
)  # fmt: skip
LLAMA31_8B = dict(LLAMA3, vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8)  # fmt: skip
MAVERICK = dict(LLAMA4, vocab_size=202048, hidden_size=5120, intermediate_size=8192,
                intermediate_size_mlp=16384, num_attention_heads=40, num_key_value_heads=8,
                head_dim=128, num_local_experts=128, attention_chunk_size=8192)  # fmt: skip
PROMPT = 4000
KV_MEMORY = 4 * 2**30  # fake tensors hold no memory, and the device's free memory cannot be measured
KERNELS = {
    "redline::decode_attention",
    "redline::prefill_attention",
    "redline::add_rms_norm",
    "redline::swiglu",
}


@pytest.mark.skipif(not interpreted(), reason="this process runs them itself")
def test_fake_cuda_in_a_child_process(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    root = Path(__file__).parent.parent
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not child_process"]
    proc = subprocess.run(
        [*command, str(Path(__file__))], env=env, cwd=root, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


@pytest.fixture(scope="module")
def fake_cuda():
    register_cuda_device_guard()
    use_h200_target()
    with FakeTensorMode(), torch.no_grad():
        yield


def fake_model(
    raw: dict, draft: bool, dtype: torch.dtype = torch.bfloat16, pdl: bool = False, bits: int | None = None
):
    """Target (and an EAGLE-3 draft over half the vocabulary) built on meta with the kernels a GPU gets,
    placed on fake cuda:0; bits: its decoder linears quantized as int4 / int8 on load does on CUDA."""
    config = ModelConfig.from_dict(raw)
    backends = Backends.choose(CUDA, dtype, compiled=False, pdl=pdl)
    aux = default_aux_layers(config.num_layers) if draft else ()
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.device("meta"):
        model = LlamaForCausalLM(config, backends=backends, aux_layers=aux).to(dtype)
        head = None
        if draft:
            head_config = draft_config_for(config, config.vocab_size // 2)
            head = Eagle3Draft(head_config, backends=backends, target_embedding=model.model.embed_tokens)
            head = head.to(dtype)
    place = lambda t: torch.empty(t.shape, dtype=t.dtype, device=CUDA)
    model._apply(place)
    model.model.rotary.materialize(CUDA)
    if bits is not None:
        weight_only = WeightOnly(bits, 32, False, dtype, gpu=True)
        for parent, name, child, full in list(decoder_targets(model, Fp8Scheme(), experts=False)):
            setattr(parent, name, weight_only.quantized(child, full))
    model.finish_loading()
    if head is not None:
        head._apply(place)
        head.rotary.materialize(CUDA)
        head.midlayer.mlp.fuse_gate_up()
    return model, head


def fake_runner(
    model, draft, k: int, max_len: int, kv_dtype: torch.dtype | None = None, tree: TreeShape | None = None
) -> ModelRunner:
    return ModelRunner(model, Shapes(4, max_len, k, tree=tree), draft, cuda_graphs=False,
                       kv_cache_dtype=kv_dtype, kv_cache_memory=KV_MEMORY)  # fmt: skip


def serve(runner: ModelRunner, prefill_log: OpLog, step_log: OpLog) -> list[torch.Tensor]:
    """A 4,000-token greedy prompt in slot 0, then short sampling prompts in slots 1-3 as one batched
    prefill (slot 3's first chunk only), then steps over 1 and 4 rows, greedy and sampling; the engine's
    calls are logged."""
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
    prompts = [tuple(range(5, 5 + PROMPT)), *(tuple(range(7, 7 + 20 * slot)) for slot in (1, 2, 3))]
    shapes = runner.shapes
    per_slot = shapes.blocks_for(shapes.cache_len)
    tables = [TableUpdate(s, 0, tuple(range(s * per_slot, (s + 1) * per_slot))) for s in range(4)]
    admitted = [SlotSetup(s, SlotSampling.of(sampled if s else SamplingParams(), s)) for s in range(4)]
    runner.slots.apply(StepPlan(tables=tuple(tables), admitted=tuple(admitted)))
    with prefill_log:
        whole = PrefillChunk(0, prompts[0], 0, final=True)
        outs = [runner.prefill.run(PrefillBatch((whole,), logits=False)).first]
        chunks = (PrefillChunk(1, prompts[1], 0, True), PrefillChunk(2, prompts[2], 0, True),
                  PrefillChunk(3, prompts[3][:30], 0, False, prompts[3][30]))  # fmt: skip
        outs.append(runner.prefill.run(PrefillBatch(chunks, logits=True)).first)
    kv_len = shapes.kv_len_for(PROMPT + 8)
    with step_log:
        for rows in (1, 4):
            for sampling in (False, True):
                outs.append(runner.run_step(rows, kv_len, sampling))
    return outs


def assert_on_device(prefill_log: OpLog, step_log: OpLog) -> None:
    """Nothing computes on the host; prefill stages its prompt ids there (torch.tensor(ids, device=...)
    builds them on the host and copies: lift_fresh). A step may not even do that: a host-to-device copy
    cannot be captured in a CUDA graph."""
    assert set(prefill_log.off_device) <= {"aten::lift_fresh"}, sorted(set(prefill_log.off_device))
    assert not step_log.off_device, (
        f"ops that produced host tensors in the step: {sorted(set(step_log.off_device))}"
    )


@in_child
@pytest.mark.parametrize("family", ["llama3", "llama4"])
@pytest.mark.parametrize("k", [0, 3])
def test_prefill_and_steps_on_fake_cuda(fake_cuda, family, k):
    model, draft = fake_model(LLAMA3 if family == "llama3" else LLAMA4, draft=k > 0)
    runner = fake_runner(model, draft, k, PROMPT + 64)
    prefill_log, step_log = OpLog(), OpLog()
    first, *_, step1_greedy, step1_sampling, step4_greedy, step4_sampling = serve(
        runner, prefill_log, step_log
    )
    assert first.shape == (1,) and first.device == CUDA
    logprobs = (k + 1) * width(model.config.vocab_size)  # the logits path's packed log-probabilities
    for out, rows, extra in [(step1_greedy, 1, 0), (step1_sampling, 1, logprobs), (step4_greedy, 4, 0),
                             (step4_sampling, 4, logprobs)]:  # fmt: skip
        assert out.shape == (rows, k + 2 + extra) and out.device == CUDA and out.dtype == torch.int64
    ops = set(prefill_log.ops) | set(step_log.ops)
    expected = KERNELS | ({"redline::moe_top1"} if family == "llama4" else set())
    assert expected <= ops, f"kernels not reached: {expected - ops}"
    assert "aten::scaled_dot_product_attention" not in ops  # cached attention stays in the kernels
    assert "redline::prefill_attention" not in step_log.ops  # a step's K + 1 queries take the split-KV kernel
    assert_on_device(prefill_log, step_log)


@in_child
@pytest.mark.parametrize(
    ("config", "nodes"), [(LLAMA3, 8), (LLAMA3, 16), (LLAMA4, 8)], ids=["8", "16", "llama4-8"]
)
def test_a_draft_tree_on_fake_cuda(fake_cuda, config, nodes):
    """A draft tree (topk 4): its steps run on the device, nothing on the host, the chain's output layout.
    Its verification takes the split-KV kernel under the tree's mask at 8 rows, and at 16 rows (more than
    the split-KV tile holds: Backends.tree_rows) the prefill kernel under that mask; Llama 4's chunked
    layers too (under the root's chunk)."""
    model, draft = fake_model(config, draft=True)
    runner = fake_runner(model, draft, 3, PROMPT + 64, tree=TreeShape(topk=4, steps=3, nodes=nodes))
    prefill_log, step_log = OpLog(), OpLog()
    *_, step1_greedy, step1_sampling, step4_greedy, step4_sampling = serve(runner, prefill_log, step_log)
    logprobs = 4 * width(model.config.vocab_size)
    for out, rows, extra in [(step1_greedy, 1, 0), (step1_sampling, 1, logprobs), (step4_greedy, 4, 0),
                             (step4_sampling, 4, logprobs)]:  # fmt: skip
        assert out.shape == (rows, 3 + 2 + extra) and out.device == CUDA
    assert "redline::decode_attention" in step_log.ops  # the draft's expansions, and an 8-row tree
    assert ("redline::prefill_attention" in step_log.ops) == (nodes > STEP_QUERIES)
    assert_on_device(prefill_log, step_log)


@in_child
def test_fp8_cache_on_fake_cuda(fake_cuda):
    model, draft = fake_model(LLAMA4, draft=True)
    runner = fake_runner(model, draft, 3, PROMPT + 64, torch.float8_e4m3fn)
    assert runner.cache.layers[0][0].dtype == torch.float8_e4m3fn
    prefill_log, step_log = OpLog(), OpLog()
    serve(runner, prefill_log, step_log)
    assert set(prefill_log.ops) | set(step_log.ops) >= KERNELS
    assert_on_device(prefill_log, step_log)


def _aot_graphs(graphs: list[torch.fx.GraphModule]):
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm: torch.fx.GraphModule, _inputs):
        graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=keep)


def _triton_launches(graph: torch.fx.GraphModule) -> list[str]:
    """Names of the Triton kernels the AOT graph launches (the kernels inductor would compile)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    return [
        kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
        for node in graph.graph.nodes
        if node.op == "call_function" and "triton_kernel_wrapper" in str(node.target)
    ]


@in_child
def test_compiled_step_traces_the_kernels(fake_cuda):
    """torch.compile(fullgraph=True) traces the decode step with kv_len a dynamic dimension (with PDL
    launches, as on an H200): AOT autograd sees the Triton kernels themselves (what inductor compiles),
    and a new kv_len compiles nothing. compiled_step.py marks kv_len unbacked; under FakeTensorMode
    dynamo ignores mark_unbacked (each kv_len would compile), so this marks it dynamic with a range."""
    torch._dynamo.reset()
    model, draft = fake_model(LLAMA4, draft=True, pdl=True)
    runner = fake_runner(model, draft, 3, 1024)
    graphs: list[torch.fx.GraphModule] = []

    def step(rows: int, kv_index: torch.Tensor, sampling: bool) -> torch.Tensor:
        return runner.step(rows, kv_index.shape[0], sampling)

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=_aot_graphs(graphs))
    cache_len = runner.shapes.cache_len
    kv_index = torch.arange(cache_len + 1, device=CUDA)
    for kv_len in (128, 512):
        view = kv_index[:kv_len]
        torch._dynamo.mark_dynamic(view, 0, min=2, max=cache_len)
        compiled(4, view, True)
    assert len(graphs) == 1
    launched = set(_triton_launches(graphs[0]))
    assert {"_split_kernel", "_add_rms_norm_kernel", "_swiglu_kernel", "_gate_up_kernel"} <= launched
    assert "_prefill_kernel" not in launched


@in_child
@pytest.mark.parametrize("family", ["llama3", "llama4"])
def test_compiled_prefill_traces_the_kernels(fake_cuda, family):
    """torch.compile(fullgraph=True) traces the cached prompt forward with the prompt length a dynamic
    dimension, as compiled_prefill.py does, into one graph through the prefill kernel: the step/prefill
    choice (attention.py) never specializes the length. The length's lower bound is 16 (the padding
    of compiled_prefill.py) or, for Llama 4, above the MoE layer's few-token branch (n <= experts)."""
    torch._dynamo.reset()
    model, _ = fake_model(LLAMA3 if family == "llama3" else LLAMA4, draft=False)
    runner = fake_runner(model, None, 0, 1024)
    graphs: list[torch.fx.GraphModule] = []

    def prefill(tokens: torch.Tensor, tables: torch.Tensor) -> tuple:
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        return model(tokens, positions, runner.cache.layers, tables, tokens.shape[1])

    compiled = torch.compile(prefill, fullgraph=True, dynamic=False, backend=_aot_graphs(graphs))
    views = runner.cache.tables(1, 1)
    shortest = 16 if family == "llama3" else model.config.num_experts + 1
    for length in (shortest, 400):
        tokens = torch.zeros((1, length), dtype=torch.int64, device=CUDA)
        torch._dynamo.mark_dynamic(tokens, 1, min=shortest, max=runner.cache.max_len)
        compiled(tokens, views)
    assert len(graphs) == 1
    launched = set(_triton_launches(graphs[0]))
    assert {"_prefill_kernel", "_add_rms_norm_kernel", "_swiglu_kernel"} <= launched
    assert "_split_kernel" not in launched


@in_child
@pytest.mark.parametrize(
    "shape, kv_dtype, pdl, bits",
    [
        (LLAMA31_8B, torch.bfloat16, True, None),
        (LLAMA31_8B, torch.float8_e4m3fn, False, None),
        (MAVERICK, torch.bfloat16, False, None),
        (LLAMA31_8B, torch.bfloat16, False, 4),
    ],
    ids=["llama3.1-8b-pdl", "llama3.1-8b-fp8-cache", "llama4-maverick", "llama3.1-8b-int4"],
)
def test_kernels_compile_for_h200(fake_cuda, shape, kv_dtype, pdl, bits):
    """Every kernel launch of a 4,000-token prefill, short prompts and K = 3 steps at real shapes (two
    layers of the 8B; four of Maverick: RoPE and NoPE, dense and MoE with 128 experts) compiles for
    sm_90 with Triton's ptxas, fits an H200's shared memory, spills no registers, and the prefill's
    bf16 products run on tensor cores (wgmma). With pdl, the split-KV kernel compiles with
    programmatic dependent launch (its gdc_wait). With int4 weights (on load) the steps' products take the
    weight-only kernel."""
    model, draft = fake_model(shape, draft=True, pdl=pdl, bits=bits)
    runner = fake_runner(model, draft, 3, PROMPT + 64, kv_dtype)
    with recorded_launches() as launches:
        serve(runner, OpLog(), OpLog())
    seen, report = set(), []
    for kernel, args, kwargs in launches:
        key = (
            kernel.fn.__name__,
            tuple(_signature(a) for a in args),
            tuple(sorted(map(str, kwargs.items()))),
        )
        if key in seen:
            continue
        seen.add(key)
        compiled = compile_for_h200(kernel, args, kwargs)
        usage = resource_usage(compiled)
        report.append(f"{kernel.fn.__name__} shared={compiled.metadata.shared} {usage}")
        assert compiled.metadata.shared <= H200_SHARED_MEMORY, report[-1]
        assert " STACK:0 " in usage, f"registers spill to local memory: {report[-1]}"
        if kernel.fn.__name__ == "_prefill_kernel":
            assert "wgmma" in compiled.asm["ptx"], report[-1]
        if kwargs.get("launch_pdl"):
            assert "griddepcontrol.wait" in compiled.asm["ptx"], report[-1]
    print("\n".join(report))
    names = {name for name, *_ in seen}
    assert {"_split_kernel", "_prefill_kernel", "_add_rms_norm_kernel", "_swiglu_kernel"} <= names
    assert "_gate_up_kernel" in names or shape is not MAVERICK
    assert any("launch_pdl" in str(key) for key in seen) == pdl
    assert ("_weight_only_kernel" in names) == (bits is not None)


def _signature(a: object) -> object:
    """What Triton specializes a launch on: tensor dtypes, and for ints whether they are 1 or multiples
    of 16 (prompt lengths 4,000 and 4,016 share a compiled kernel)."""
    if isinstance(a, torch.Tensor):
        return a.dtype
    if isinstance(a, int) and not isinstance(a, bool):
        return ("int", a == 1, a % 16 == 0)
    return a


@in_child
@pytest.mark.parametrize("bits, act_order", [(4, False), (8, False), (4, True)])
def test_weight_only_linears_on_fake_cuda(fake_cuda, bits, act_order):
    """int4 / int8 on load on CUDA (quant/weight_only_gpu.py), and those linears wrapped as an act-order
    GPTQ checkpoint's are (InputOrdered, a permutation of the input on the device: models/int_checkpoint.py
    loads them so): the 4,000-token prefill, a batched prefill and steps of 1 and 4 rows run on the device,
    the steps' products through the weight-only kernel."""
    model, _ = fake_model(dict(LLAMA3, intermediate_size=128), draft=False, bits=bits)  # groups of 32
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "GpuWeightOnlyLinear"
    if act_order:
        for parent, name, child, _ in list(decoder_targets(model, Fp8Scheme(), experts=False)):
            setattr(parent, name, InputOrdered(child, torch.randperm(child.in_features, device=CUDA)))
    prefill_log, step_log = OpLog(), OpLog()
    serve(fake_runner(model, None, 0, PROMPT + 64), prefill_log, step_log)
    assert "redline::weight_only_mm" in step_log.ops
    assert_on_device(prefill_log, step_log)
