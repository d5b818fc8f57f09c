"""Regional compilation: inside torch.compile every decoder layer of a kind is one nested compile region,
traced once and called once per layer; compiled engines are the default on CPU."""

from __future__ import annotations

import torch
import torch._dynamo
from conftest import llama3_hf_config

from redline.config import ModelConfig
from redline.engine_config import EngineConfig
from redline.kernels.paged_kv import gather_blocks
from redline.layers.backends import Backends
from redline.models.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM
from redline.runner.build import compiles
from redline.train.random_init import normal_init


def test_the_layers_of_a_model_share_one_compiled_region():
    """Four layers, one decode forward through a graph-recording backend: four invoke_subgraph calls of
    one subgraph, the cache writes inside it landing in each layer's own cache."""
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
