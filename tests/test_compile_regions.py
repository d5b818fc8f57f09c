"""Regional compilation: inside torch.compile every decoder layer of a kind is one nested compile region,
traced once and called once per layer; compiled engines are the default on CPU."""

from __future__ import annotations

import os
import subprocess

import torch
import torch._dynamo
from conftest import llama3_hf_config
from torch._dynamo.variables import invoke_subgraph

from redline.config import ModelConfig
from redline.engine_config import EngineConfig
from redline.kernels.paged_kv import gather_blocks
from redline.layers.backends import Backends
from redline.models.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM
from redline.runner.build import compiles
from redline.runner.compiling import remember_isa_probes
from redline.train.random_init import normal_init


def test_the_layers_of_a_model_share_one_compiled_region(monkeypatch):
    """Four layers, one decode forward through a graph-recording backend: four invoke_subgraph calls of
    one subgraph, the cache writes inside it landing in each layer's own cache. The region's arguments are
    flat, so dynamo matches each call without flattening them through pytree (a third of a warm start)."""
    raw = llama3_hf_config(num_hidden_layers=4).to_dict()
    config = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    model = LlamaForCausalLM(config, backends=Backends.choose("cpu", torch.float32, compiled=True)).eval()
    normal_init(model, std=0.1)
    assert model.layer_regions
    cache = KVCache(config, 1, 64, torch.float32, torch.device("cpu"))
    tokens, positions = torch.tensor([[5, 7]]), torch.tensor([[3, 4]])

    def forward(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(tokens, positions, cache.layers, cache.tables(0, 1), 64)[0]

    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    flattened = []
    monkeypatch.setattr(invoke_subgraph, "build_fingerprint_with_pytree", lambda *a: flattened.append(a))
    torch._dynamo.reset()
    with torch.inference_mode():
        got = torch.compile(forward, backend=backend, fullgraph=True)(tokens, positions)
        keys = [gather_blocks(k, cache.tables(0, 1), 5)[0, :, 3:5].clone() for k, _ in cache.layers]
        want = forward(tokens, positions)
    [graph] = graphs
    calls = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 4
    assert len({call.args[0].target for call in calls}) == 1  # one traced body for every layer
    torch.testing.assert_close(got, want)
    assert not flattened
    for key, (k, _) in zip(keys, cache.layers, strict=True):  # each layer wrote its own cache
        torch.testing.assert_close(key, gather_blocks(k, cache.tables(0, 1), 5)[0, :, 3:5])
        assert key.abs().sum() > 0


def test_engines_compile_on_cpu_unless_the_environment_says_not(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setenv("REDLINE_COMPILE", "1")
    assert compiles(EngineConfig.create("m"), cpu) and not compiles(EngineConfig.create("m"), cuda)
    assert not compiles(EngineConfig.create("m", compile=False), cpu)
    monkeypatch.setenv("REDLINE_COMPILE", "0")
    assert not compiles(EngineConfig.create("m"), cpu)
    assert compiles(EngineConfig.create("m", compile=True), cpu)


def test_a_library_that_loaded_once_is_not_probed_again(tmp_path, monkeypatch):
    """remember_isa_probes: inductor's dlopen probe runs once per library; a rebuilt library, or one that
    fails to load, is probed each time."""
    from torch._inductor import cpu_vec_isa

    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", cpu_vec_isa.VecISA._probe_load)  # restored after
    remember_isa_probes()
    remember_isa_probes()  # once only: the probe is wrapped a single time
    isa = cpu_vec_isa.pick_vec_isa()
    built = tmp_path / "lib.so"
    source = b"int f(void) { return 1; }"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), "-x", "c", "-"], input=source, check=True)
    spawned = []
    run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: spawned.append(a) or run(*a, **kw))
    assert isa._probe_load(str(built)) and len(spawned) == 1
    assert isa._probe_load(str(built)) and len(spawned) == 1  # remembered
    later = built.stat().st_mtime + 10
    os.utime(built, (later, later))  # rebuilt
    assert isa._probe_load(str(built)) and len(spawned) == 2
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not a library")
    assert not isa._probe_load(str(broken)) and not isa._probe_load(str(broken)) and len(spawned) == 4
