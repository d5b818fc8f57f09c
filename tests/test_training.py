"""train-target and train-draft end to end on a tiny scale, and the TTT unroll against inference."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch
from conftest import TINY_DRAFT, TINY_TARGET

from redline import LLM, SamplingParams
from redline.cli import build_parser
from redline.config import ModelConfig
from redline.models.build import load_target, load_with_draft
from redline.models.eagle3 import Eagle3Draft, default_aux_layers, draft_config_for, save_draft
from redline.models.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM
from redline.tokenizer import Tokenizer
from redline.train import data
from redline.train.budget import MIN_STEPS, REGEN_SHARE, Plan, plan_training, regen_deadline
from redline.train.draft import acceptance_length, held_out_prompts, new_draft, train_draft
from redline.train.features import DraftData, Sample, draft_vocabulary, responds_mask
from redline.train.random_init import llama3_config
from redline.train.regenerate import chat_prompts, first_turn, regenerate
from redline.train.target import train_target
from redline.train.ttt import chain_attention, shift_rows, ttt_unroll


def test_trained_draft_is_accepted_far_more_than_untrained(trained):
    target = load_target(trained / "target", torch.float32)
    features = DraftData.load(trained / "draft" / "draft_data.pt")
    save_draft(new_draft(target, TINY_DRAFT, features.vocab), trained / "untrained")
    prompts = held_out_prompts(trained / "target", 8, 24)
    untrained = acceptance_length(trained / "target", trained / "untrained", prompts, 40)
    learned = acceptance_length(trained / "target", trained / "draft", prompts, 40)
    # K = 3: 1.0 means nothing accepted, 4.0 everything; the random draft sits near 1
    assert untrained < 1.5
    assert learned > untrained + 1.0, (learned, untrained)


def test_target_writes_hf_format_and_transformers_agrees(trained):
    transformers = pytest.importorskip("transformers")
    target_dir = trained / "target"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (target_dir / name).is_file()
    assert "chat_template" in json.loads((target_dir / "tokenizer_config.json").read_text())
    summary = json.loads((target_dir / "train_log.json").read_text())["summary"]
    assert summary["held_out_loss"] < 6.0  # ln(384) = 5.95 is the loss of a uniform guess

    prompt = held_out_prompts(target_dir, 1, 24, seed=5)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
        )
    expected = out[0, len(prompt) :].tolist()
    llm = LLM(target_dir, dtype="float32", max_batch=1)
    got = llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids
    assert got == expected


def test_saved_draft_reloads_bit_exactly(trained):
    trained_state = torch.load(trained / "draft" / "checkpoint.pt", weights_only=True)["module"]
    _, reloaded = load_with_draft(trained / "target", trained / "draft", torch.float32)
    reloaded = reloaded.state_dict()
    assert reloaded.keys() == trained_state.keys()
    for name, tensor in trained_state.items():
        assert torch.equal(reloaded[name], tensor), name


def test_resume_continues_exactly(trained, tmp_path):
    recipe = replace(TINY_DRAFT, steps=6, num_prompts=8, gen_len=16)
    train_draft(trained / "target", tmp_path / "whole", recipe)
    train_draft(trained / "target", tmp_path / "split", recipe, stop_after=3)
    first_half = json.loads((tmp_path / "split" / "train_log.json").read_text())["summary"]["steps_done"]
    train_draft(trained / "target", tmp_path / "split", recipe, resume=True)
    assert first_half == 3
    whole = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    split = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)
    assert split["step"] == whole["step"] == 6
    for name, tensor in whole["module"].items():
        assert torch.equal(split["module"][name], tensor), name


def test_resume_with_nothing_to_resume_is_a_clear_error(trained, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train_draft(trained / "target", tmp_path, TINY_DRAFT, resume=True)


def tiny_draft_pair(seed: int = 0) -> tuple[LlamaForCausalLM, Eagle3Draft]:
    torch.manual_seed(seed)
    config = ModelConfig.from_dict(llama3_config(64, hidden_size=32, intermediate_size=64))
    target = LlamaForCausalLM(config, aux_layers=default_aux_layers(config.num_layers))
    draft = Eagle3Draft(
        draft_config_for(config, draft_vocab_size=40), target_embedding=target.model.embed_tokens
    )
    with torch.no_grad():
        for p in [*target.parameters(), *draft.parameters()]:
            p.normal_(0.0, 0.3)
    return target, draft


def inference_chain(draft: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor, p: int, step: int):
    """The draft's hidden state [H] at row p after `step` own steps, as the engine computes it: prefill of
    rows 0..p-step with target features, then single-token steps on its own hidden state. tokens [1, T],
    aux [1, T, 3H] of one sequence starting at position 0."""
    kv = KVCache(draft.config.layer, 1, 64, torch.float32, torch.device("cpu"))
    cache, tables = kv.layers[0], kv.tables(0, 1)
    start = p - step  # the last row with target features
    rows = torch.arange(start + 1)[None]
    h = draft(tokens[:, 1 : start + 2], draft.fuse(aux[:, : start + 1]), rows, cache, tables, 64)[:, -1:]
    for position in range(start + 1, p + 1):
        h = draft(tokens[:, position + 1 : position + 2], h, torch.tensor([[position]]), cache, tables, 64)
    return h[0, 0]


def test_ttt_unroll_equals_the_inference_chain_in_packed_sequences():
    """Step i, row p of the unroll over a window of packed sequences = the engine's chain on p's own
    sequence (from its start, at its own positions): prefill up to p - i, then i own steps. Rows whose
    chain would reach into the previous sequence are the ones ttt_loss leaves unscored."""
    _, draft = tiny_draft_pair()
    lengths, steps = (9, 13, 6), 4
    t = sum(lengths)
    tokens = torch.randint(0, 64, (1, t))
    aux = torch.randn(1, t, 3 * 32)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    with torch.no_grad():
        unrolled = ttt_unroll(draft, tokens, aux, segments, steps)
        checked = 0
        for step in range(steps):
            for p in range(t - 1):
                seq = int(segments[0, p])
                s, n = starts[seq], lengths[seq]
                if p - step < s or p + 1 >= s + n:  # no chain of `step` own steps, or no next token
                    continue
                expected = inference_chain(draft, tokens[:, s : s + n], aux[:, s : s + n], p - s, step)
                torch.testing.assert_close(unrolled[step][0, p], expected, atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked == sum(max(0, n - 1 - i) for n in lengths for i in range(steps))


def ttt_mask(rows: int, step: int) -> torch.Tensor:
    """The dense reference: [rows, (step + 1) * rows] bool over all steps' keys, step-major. Row p of step
    i sees step-0 keys <= p - i and step j's key at p - (i - j)."""
    p = torch.arange(rows)[:, None]  # [rows, 1] query row
    r = torch.arange(rows)[None, :]  # [1, rows] key row within a step's block
    return torch.cat([r <= p - step] + [r == p - (step - j) for j in range(1, step + 1)], dim=1)


def test_ttt_mask_worked_example():
    assert ttt_mask(4, 1).int().tolist() == [
        [0, 0, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1],
    ]


@pytest.mark.parametrize(
    "step, b, rows, heads, kv_heads, d",
    [(0, 2, 7, 4, 2, 8), (1, 2, 7, 4, 2, 8), (3, 2, 7, 4, 2, 8),
     (2, 1, 511, 9, 3, 64)],  # the demo recipe: a 512-token window (511 rows), SmolLM2's draft heads
)  # fmt: skip
def test_chain_attention_equals_dense_attention_under_the_ttt_mask(step, b, rows, heads, kv_heads, d):
    torch.manual_seed(step + rows)
    q = torch.randn(b, rows, heads, d)
    keys = [torch.randn(b, rows, kv_heads, d) for _ in range(step + 1)]
    values = [torch.randn(b, rows, kv_heads, d) for _ in range(step + 1)]
    got = chain_attention(q, keys, values, torch.zeros(b, rows, dtype=torch.int64))

    def dense(x: list[torch.Tensor]) -> torch.Tensor:  # step-major keys, per query head: [B, heads, S, D]
        return torch.cat(x, dim=1).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)

    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), dense(keys), dense(values), attn_mask=ttt_mask(rows, step)
    ).transpose(1, 2).reshape(b, rows, heads * d)  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)  # fp32 sums over up to 1,533 keys


def test_shift_rows_worked_example():
    x = torch.tensor([[1, 2, 3]])
    assert shift_rows(x, 1, fill=-1).tolist() == [[-1, 1, 2]]
    assert shift_rows(x, 0).tolist() == [[1, 2, 3]]


def test_draft_vocabulary_by_frequency():
    assert draft_vocabulary(torch.tensor([3, 3, 7, 1, 3, 7]), 10, 2).tolist() == [3, 7]
    assert draft_vocabulary(torch.tensor([5, 5]), 10, 3).tolist() == [0, 1, 5]


def test_packed_features_mark_responses_and_cut_windows():
    samples = [Sample([10, 11, 12, 13], 2), Sample([20, 21, 22], 1)]
    # prompt [10 11] + response [12 13]: 11 predicts 12, 12 predicts 13; 13's next token is 20
    assert responds_mask(samples).int().tolist() == [0, 1, 1, 0, 1, 1, 0]
    features = DraftData(
        tokens=torch.tensor([t for s in samples for t in s.tokens]),
        segments=torch.tensor([0, 0, 0, 0, 1, 1, 1]),
        responds=responds_mask(samples),
        aux=torch.arange(7.0)[:, None].expand(7, 6),
        final=torch.arange(7.0)[:, None].expand(7, 2),
        vocab=torch.tensor([12, 21, 22]),  # 13 is out of the draft vocabulary: position 2 is not scored
    )
    assert features.num_sequences == 2
    assert features.scored.int().tolist() == [0, 1, 0, 0, 1, 1, 0]
    w = features.windows([2, 3], 3)
    assert w["tokens"].tolist() == [[12, 13, 20], [13, 20, 21]]
    assert w["segments"].tolist() == [[0, 0, 1], [0, 1, 1]]
    assert w["aux"].shape == (2, 3, 6) and w["final"][1, :, 0].tolist() == [3.0, 4.0, 5.0]


def test_budget_plan_arithmetic(tmp_path):
    plan = plan_training(600.0, 250.0, 2.0)
    assert plan.steps == 170  # (600 - 250 - 10 reserved) / 2
    assert plan_training(600.0, 599.0, 2.0).steps == MIN_STEPS
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    # 600 s: answering stops REGEN_SHARE * 600 = 240 s after the start, less what a resumed run already did
    assert regen_deadline(600.0, 0.0, now=1000.0) == 1000.0 + REGEN_SHARE * 600.0
    assert regen_deadline(600.0, 100.0, now=1000.0) == 1000.0 + REGEN_SHARE * 600.0 - 100.0


def test_chat_prompts_take_the_first_user_turn(tokenizer_dir):
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    conversations = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}],
        [{"role": "assistant", "content": "no user turn"}],
        [{"role": "user", "content": "   "}],
        [{"role": "user", "content": "word " * 500}],
    ]  # fmt: skip
    assert first_turn(conversations[0]) == conversations[0][:2]
    chosen = chat_prompts(tokenizer, conversations, max_len=64)
    assert [i for i, _ in chosen] == [0]  # no user turn, an empty one, and one over 64 tokens are left out
    assert chosen[0][1] == tokenizer.encode_chat(conversations[0][:2])


def test_regenerate_resumes_and_its_deadline_keeps_partial_answers(trained):
    llm = LLM(trained / "target", dtype="float32", max_batch=2, max_seq_len=128)
    prompts = held_out_prompts(trained / "target", 6, 16)

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=24, ignore_eos=True)

    whole = regenerate(llm, prompts, params, {})
    assert sorted(whole) == list(range(6)) and all(len(s.tokens) == 16 + 24 for s in whole.values())
    resumed = regenerate(llm, prompts, params, {0: whole[0], 3: whole[3]})
    assert resumed == whole

    step = llm.engine.step

    def slow_step():  # 0.2 s per engine step: the deadline falls a few steps in
        time.sleep(0.2)
        return step()

    llm.engine.step = slow_step
    saves = []
    partial = regenerate(llm, prompts, params, {}, time.perf_counter() + 1.0, lambda: saves.append(1))
    assert saves  # saved at the end
    assert 0 < len(partial) <= 2  # two slots: the requests in flight at the deadline, nothing started later
    for i, s in partial.items():
        assert s.prompt_len == 16 and 16 < len(s.tokens) < 16 + 24
        assert s.tokens == whole[i].tokens[: len(s.tokens)]  # a prefix of the same greedy answer


def test_train_draft_cli_takes_data_and_a_budget():
    args = build_parser().parse_args(
        ["train-draft", "--target", "t", "--out", "o", "--data", "sharegpt", "--budget-minutes", "60"]
    )
    assert (args.data, args.budget_minutes) == ("sharegpt", 60.0)
    assert build_parser().parse_args(["train-draft", "--target", "t", "--out", "o"]).budget_minutes is None


def test_load_texts_formats_and_errors(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "a"}\n{"prompt": "b"}\n{"messages": [{"role": "user", "content": "c"}]}\n')
    assert data.load_texts(jsonl) == ["a", "b", "c"]
    jsonl.write_text('{"text": "a"}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match="d.jsonl:2"):
        data.load_texts(jsonl)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_texts(tmp_path / "missing")


def test_train_target_is_deterministic_for_a_seed(tmp_path):
    recipe = replace(TINY_TARGET, steps=4)
    for name in ("a", "b"):
        train_target(tmp_path / name, recipe)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    other = replace(recipe, seed=1)
    train_target(tmp_path / "c", other)
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != (
        tmp_path / "a" / "model.safetensors"
    ).read_bytes()


def test_a_draft_started_from_its_target_computes_the_targets_last_layer():
    """init "target" (train/draft_init.py): with its embedding half silenced, the draft's layer over a
    hidden state is the target's last decoder layer over it, and fc hands it the highest aux state."""
    from redline.layers.attention import AttentionBatch
    from redline.train.draft_init import init_from_target

    config = ModelConfig.from_dict(llama3_config(256, num_hidden_layers=4))
    target = LlamaForCausalLM(config, aux_layers=default_aux_layers(4))
    for p in target.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    draft = Eagle3Draft(draft_config_for(config, 128), target_embedding=target.model.embed_tokens)
    init_from_target(draft, target)
    h, tokens = config.hidden_size, torch.randint(0, 256, (1, 12))
    positions = torch.arange(12)[None]
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(draft.midlayer.self_attn, name).weight[:, :h] = 0
        hidden = torch.randn(1, 12, h)
        batch = AttentionBatch.build(config, target.model.rotary, positions, positions, None)
        want = target.model.layers[-1](hidden, batch, None)
        draft_batch = AttentionBatch.build(draft.config.layer, draft.rotary, positions, positions, None)
        got = draft.midlayer(draft.embed(tokens), hidden, draft_batch, None)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        aux = torch.randn(1, 12, 3 * h)
        torch.testing.assert_close(draft.fuse(aux), aux[..., 2 * h :])
    with pytest.raises(ValueError, match="intermediate size"):
        init_from_target(Eagle3Draft(draft_config_for(config, 128, 96)), target)
