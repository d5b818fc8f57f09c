"""Adaptive draft length: the policy on its own (no model), steps that verify no drafts keeping the
drafter's state whole, and greedy output that stays plain decoding's whichever steps draft."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import build_hf_model, greedy_divergence_is_a_near_tie, llama3_hf_config, save_hf_model

from redline import LLM, SamplingParams
from redline.engine.draft_length import (
    DEFAULT_COST,
    PLAIN_PROBE,
    PROBE_MAX,
    PROBE_MIN,
    PROBE_SHARE,
    DraftLength,
)
from redline.kernels.paged_kv import BLOCK
from redline.runner.one_slot import fill_slot, release_slot
from redline.speculative.deferred_keys import DEFERRED
from redline.train.random_init import write_random_draft


def run_policy(policy: DraftLength, slots: list[int], accept, steps: int, step_time) -> list[int]:
    """`steps` decisions; accept(slot, k) -> drafts accepted; step_time(k) -> seconds. Returns each k."""
    for s in slots:
        policy.admit(s)
    chosen = []
    for _ in range(steps):
        k = policy.choose(len(slots), slots)
        policy.observe(len(slots), k, step_time(k), {s: accept(s, k) for s in slots})
        chosen.append(k)
    return chosen


def test_a_draft_never_accepted_stops_drafting_but_for_rarer_probes():
    policy = DraftLength(3, adaptive=True)
    chosen = run_policy(policy, [0], lambda s, k: 0, 2000, lambda k: 1.3 if k else 1.0)
    assert chosen[:3] == [3, 3, 3]  # a new slot starts from the prior (1.0): it drafts at first
    tail = chosen[1000:]
    assert 0 < sum(k > 0 for k in tail) <= 2 * len(tail) // PROBE_MAX + 2  # probes only, each of 2 steps
    assert policy.probe == PROBE_MAX and policy.prior < 0.5 and policy.cost(1) == pytest.approx(1.3)


def test_probes_grow_rarer_where_drafting_costs_more():
    """At c = 2.5 (batch 16 on 2 cores) a never-accepted draft's probes end up 600 steps apart: their two
    drafting steps cost 3 steps more than two without, PROBE_SHARE of 600."""
    policy = DraftLength(3, adaptive=True)
    chosen = run_policy(policy, [0], lambda s, k: 0, 8000, lambda k: 2.5 if k else 1.0)
    assert policy.probe == policy.longest_gap(1) == 600
    tail = chosen[4000:]
    assert 1.5 * sum(k > 0 for k in tail) / len(tail) <= 1.2 * PROBE_SHARE


def test_the_first_probes_keep_their_distance_where_drafting_costs_more():
    """Both ends of the gap scale with c: at c = 2.5 the gaps run 40, 80, ... 600 steps (a probe's 3 extra
    steps 7.5% of the first, as at c = 1.3 over 8 steps), at c = 1.3 from PROBE_MIN to PROBE_MAX."""
    for cost, gaps in ((2.5, [40, 80, 160, 320, 600, 600]), (1.3, [8, 16, 32, 64, 128, 128])):
        policy = DraftLength(3, adaptive=True)
        chosen = run_policy(policy, [0], lambda s, k: 0, 1900, lambda k, c=cost: c if k else 1.0)
        runs = [(k, len(list(group))) for k, group in itertools.groupby(chosen)]
        assert runs[0] == (3, 3)  # from the prior (1.0) until the first measures pull it down
        assert all(run == (3, 2) for run in runs[2:-1:2])  # then probes of two steps
        assert [n for k, n in runs[1:-1:2]][: len(gaps)] == gaps


def test_a_stale_estimate_takes_its_first_measure_at_double_weight():
    """New slots (from the prior) and slots whose batch chose not to draft: weight 0.5, then 0.25."""
    policy = DraftLength(3, adaptive=True)
    policy.admit(0)
    policy.observe(1, 3, 1.3, {0: 3})
    assert policy.rate[0] == pytest.approx(0.5 * 1.0 + 0.5 * 3)
    policy.observe(1, 3, 1.3, {0: 3})
    assert policy.rate[0] == pytest.approx(0.75 * 2.0 + 0.25 * 3)
    for _ in range(8):
        policy.observe(1, 3, 1.3, {0: 0})
    low = 2.25 * 0.75**8  # 0.23: under c - 1 = 0.3
    assert policy.rate[0] == pytest.approx(low) and policy.choose(1, [0]) == 0  # stale from here
    policy.observe(1, 0, 1.0, {0: 0})
    policy.observe(1, 3, 1.3, {0: 0})  # verifies the bonus token copied: not counted
    assert policy.rate[0] == pytest.approx(low)
    policy.observe(1, 3, 1.3, {0: 3})
    assert policy.rate[0] == pytest.approx(0.5 * low + 0.5 * 3)
    policy.observe(1, 3, 1.3, {0: 3})
    assert policy.rate[0] == pytest.approx(0.75 * (0.5 * low + 1.5) + 0.75)


def test_a_request_accepted_after_hopeless_ones_drafts_from_its_first_probe():
    """Requests whose drafts are never accepted pull the prior down, so the next request starts without
    drafting; one whose drafts are accepted (1 of 3 per step at c = 1.4) is found at its first probe."""
    policy = DraftLength(3, adaptive=True)
    step_time = lambda k: 1.4 if k else 1.0
    for _ in range(20):
        run_policy(policy, [0], lambda s, k: 0, 128, step_time)
        policy.release(0)
    assert policy.prior < 0.4  # below c - 1: a new slot starts without drafting
    chosen = run_policy(policy, [0], lambda s, k: 1 if k else 0, 400, step_time)
    assert chosen[0] == 0
    first = chosen.index(3)
    assert first <= policy.longest_gap(1) + 1
    assert chosen[first:].count(0) <= len(chosen[first:]) // PLAIN_PROBE  # but the steps timing c anew


def test_a_draft_accepted_keeps_drafting():
    policy = DraftLength(3, adaptive=True)
    chosen = run_policy(policy, [0, 1], lambda s, k: 2 if k else 0, 600, lambda k: 1.3 if k else 1.0)
    # three steps without drafts timed early, then one in 257
    assert chosen.count(0) == 3 + (len(chosen) - 3 * (PROBE_MIN + 1)) // (PLAIN_PROBE + 1)


def test_one_slot_that_accepts_carries_a_batch_that_does_not():
    """gain = sum of the slots' estimates against (c - 1) n: one slot at 2 of 3 pays for four at 0 when
    c = 1.2 (2 > 0.8), not for twenty (2 < 4)."""
    for slots, drafting in ((5, True), (21, False)):
        policy = DraftLength(3, adaptive=True)
        accept = lambda s, k: 2 if k and s == 0 else 0
        chosen = run_policy(policy, list(range(slots)), accept, 600, lambda k: 1.2 if k else 1.0)
        assert (sum(k > 0 for k in chosen[300:]) > 250) == drafting


def test_stale_drafts_are_not_counted():
    """With an EAGLE-3 draft a step that drafts nothing leaves the bonus token pending: the first drafting
    step after it says nothing about the draft, so the slot's estimate skips it."""
    policy = DraftLength(3, adaptive=True)
    policy.admit(0)
    policy.observe(1, 0, 1.0, {0: 0})  # drafted nothing: slot 0's pending drafts are stale
    policy.observe(1, 3, 1.3, {0: 0})  # verifies them: not counted
    assert policy.rate[0] == 1.0
    policy.observe(1, 3, 1.3, {0: 3})  # fresh: counted
    assert policy.rate[0] > 1.0
    ngram = DraftLength(3, adaptive=True, fresh_without_drafting=True)  # lookup still proposes
    ngram.admit(0)
    ngram.observe(1, 0, 1.0, {0: 0})
    ngram.observe(1, 3, 1.3, {0: 0})
    assert ngram.rate[0] < 1.0


def test_a_batch_with_a_seeded_sampled_request_drafts():
    """Its tokens must not depend on what the other slots accept or on timing."""
    policy = DraftLength(3, adaptive=True)
    run_policy(policy, [0], lambda s, k: 0, 100, lambda k: 1.3 if k else 1.0)
    assert policy.choose(1, [0]) == 0 and policy.choose(1, [0], seeded=True) == 3


def test_a_slow_step_without_drafts_is_timed_again():
    """A step without drafts timed slow (a prefill's tail in it, say) makes drafting look free; a batch
    that drafts 256 steps in a row takes one without, so the estimate recovers; one stray time among
    several does not move it (medians)."""
    policy = DraftLength(3, adaptive=True)
    policy.admit(0)
    policy.observe(1, 0, 2.0, {0: 0})
    assert policy.cost(1) == DEFAULT_COST
    policy.observe(1, 3, 1.3, {0: 0})
    assert policy.cost(1) == 1.0  # 0.65 taken as 1
    chosen = run_policy(policy, [0], lambda s, k: 1 if k else 0, 800, lambda k: 1.3 if k else 1.0)
    assert chosen.count(0) >= 3 and policy.cost(1) == pytest.approx(1.3)
    for seconds in (1.0, 1.0, 3.0):
        policy.observe(1, 0, seconds, {0: 0})
    assert policy.cost(1) == pytest.approx(1.3)


def test_the_logits_path_and_the_argmax_path_are_timed_apart():
    """Argmax steps of 1.0 / 1.3 s and logits-path steps of 3.0 / 3.3 s (sampling: with compile_sampling
    off, eager beside built argmax steps) give each path its own c, 1.3 and 1.1, where one pool of times
    could give anything from 1.3 / 3.0 to 3.3 / 1.0, as the traffic mixed them. A batch that only samples
    times its path's plain steps: after 3 of them it drafts on, no plain step in its next PLAIN_PROBE."""
    policy = DraftLength(3, adaptive=True)
    for logits, plain in ((False, 1.0), (True, 3.0)):
        for _ in range(3):
            policy.observe(1, 0, plain, {0: 0}, logits=logits)
            policy.observe(1, 3, plain + 0.3, {0: 3}, logits=logits)
    assert policy.cost(1) == pytest.approx(1.3) and policy.cost(1, logits=True) == pytest.approx(1.1)
    sampled = DraftLength(3, adaptive=True)
    sampled.admit(0)
    chosen = []
    for _ in range(PLAIN_PROBE):
        k = sampled.choose(1, [0], logits=True)
        sampled.observe(1, k, 3.3 if k else 3.0, {0: 1 if k else 0}, logits=True)
        chosen.append(k)
    plain = [i for i, k in enumerate(chosen) if k == 0]
    assert len(plain) == 3 and plain[-1] < 3 * (PROBE_MIN + 1)
    assert {path for _, _, path in sampled.seconds} == {True}


def test_a_bucket_not_yet_timed_borrows_the_nearest_timed_buckets_cost_for_its_gaps():
    """Batch 16 timed at c = 2.5 (probes 600 steps apart): bucket 8, seen only beside prefills (untimed),
    takes 16's c for its gaps, so a batch ramping up through it does not probe every 128 steps (the
    default's gap); its choice to draft keeps the default c. A new runner's buckets are untimed again."""
    policy = DraftLength(3, adaptive=True)
    slots = list(range(16))
    run_policy(policy, slots, lambda s, k: 0, 3000, lambda k: 2.5 if k else 1.0)
    policy.observe(1, 3, 1.2, {})
    policy.observe(1, 0, 1.0, {})
    borrowed = lambda rows: policy.cost(rows, borrow=True)
    assert borrowed(8) == borrowed(4) == policy.cost(16) == pytest.approx(2.5)  # 4: as near 1 as 16
    assert borrowed(2) == policy.cost(1) == pytest.approx(1.2)  # bucket 1 is nearer than 16
    assert policy.cost(8) == DEFAULT_COST
    assert policy.longest_gap(8) == 600 and policy.probe == 600
    policy.since_drafting = 0  # as after a probe
    for _ in range(600):
        assert policy.choose(8, slots[:8]) == 0
        policy.observe(8, 0, None, {s: 0 for s in slots[:8]})
    assert policy.choose(8, slots[:8]) == 3  # the probe comes
    policy.observe(1, 0, 1.0, {}, runner=1)
    assert borrowed(8) == DEFAULT_COST and policy.longest_gap(8) == PROBE_MAX


def test_a_slot_left_alone_drafts_where_drafting_pays_whatever_the_batch_cost():
    """16 slots accepting 1 of 3 at c = 2.5 do not draft (16 < 24); when 15 leave, the last one alone at
    bucket 1 (c = 1.3 there, never timed: its steps while the others were admitted shared a prefill's
    plan) drafts from its first step: 2 tokens per 1.3 steps. Borrowing bucket 16's c would wait for a
    probe 600 steps away."""
    policy = DraftLength(3, adaptive=True)
    slots = list(range(16))
    run_policy(policy, slots, lambda s, k: 1 if k else 0, 2000, lambda k: 2.5 if k else 1.0)
    for s in slots[1:]:
        policy.release(s)
    chosen = []
    for _ in range(100):
        k = policy.choose(1, [0])
        policy.observe(1, k, 1.3 if k else 1.0, {0: 1 if k else 0})
        chosen.append(k)
    assert chosen[0] == 3 and chosen.count(3) > 90


def test_without_adaptive_every_step_drafts():
    policy = DraftLength(3, adaptive=False)
    assert set(run_policy(policy, [0], lambda s, k: 0, 50, lambda k: 1.0)) == {3}
    assert DraftLength(3, adaptive=True).cost(4) == DEFAULT_COST  # no step timed yet


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("draft_length")
    target = save_hf_model(build_hf_model(llama3_hf_config(num_hidden_layers=4)), root / "t", tokenizer_dir)
    return target, write_random_draft(target, root / "d", draft_vocab=200)


def draft_keys(runner, upto: int, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot's draft keys and values at positions [0, upto): [upto, kv_heads, head_dim] each."""
    positions = torch.arange(upto)
    blocks = runner.cache.table[slot, positions // BLOCK].long()
    k, v = runner.slots.draft_cache.layers[0]
    return k[blocks, :, positions % BLOCK], v[blocks, :, positions % BLOCK]


def clear(cache) -> None:
    for keys, values in cache.layers:
        keys.zero_()
        values.zero_()


@torch.inference_mode()
@pytest.mark.parametrize("ending", ["drafting", "flushed", "a tree drafting"])
def test_steps_without_drafts_keep_the_draft_cache_whole(pair, ending):
    """The draft's keys and values after steps that verify K drafts and steps that verify none, mixed
    at random with a run of 3 x DEFERRED + 5 steps without drafts (three full rings and a part), equal
    those of K-only steps at every position both runs have settled (the token after it known), and so do
    the tokens: the keys a step without drafts defers are written by the next drafting step or, when the
    run ends without one, by the pass a compiled twin's takeover makes (write_deferred_keys). The same with
    a draft tree (topk 2, 6 rows)."""
    target, draft = pair
    tree = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6) if "tree" in ending else {}
    llm = LLM(target, dtype="float32", max_batch=1, max_seq_len=256, draft=draft, num_draft_tokens=3, **tree)
    runner, prompt = llm.runner, torch.randint(5, 384, (40,)).tolist()
    pattern = (torch.rand(30) < 0.5).tolist() + [False] * (3 * DEFERRED + 5)
    pattern += [True] if ending.endswith("drafting") else []
    runs = []
    for kinds in ([True] * len(pattern), pattern):
        clear(runner.slots.draft_cache)  # nothing left from the run before
        fill_slot(runner, prompt, positions=256)
        tokens = []
        for drafting in kinds:
            kv_len = runner.shapes.kv_len_for(int(runner.state.pos[0]))
            out = runner.run_step(1, kv_len, False, 3 if drafting else 0)[0].tolist()
            tokens += out[: out[-1] + 1]
        settled = int(runner.state.pos[0])  # the row at pos - 1 knows its next token
        runner.write_deferred_keys()  # what the ring still holds (nothing after a drafting step)
        runs.append((tokens, settled, [t.clone() for t in draft_keys(runner, settled)]))
        release_slot(runner)
    (want, n_want, kv_want), (got, n_got, kv_got) = runs
    n = min(len(want), len(got))
    assert got[:n] == want[:n]
    upto = min(n_want, n_got)
    assert upto > 40 + 3 * DEFERRED
    for a, b in zip(kv_want, kv_got, strict=True):
        torch.testing.assert_close(b[:upto], a[:upto], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_deferred_keys_land_in_each_slots_own_blocks(pair):
    """Three slots at different positions, the batch bucket holding a free row, 20 steps without drafts
    then one that drafts: each slot's draft keys equal those of a run that drafted at every step, and
    the blocks no slot holds are untouched."""
    target, draft = pair
    llm = LLM(target, dtype="float32", max_batch=8, max_seq_len=256, draft=draft, num_draft_tokens=3)
    runner = llm.runner
    slots = {0: 40, 1: 17, 3: 63}  # slot -> prompt length; slot 2 stays free
    prompts = {slot: torch.randint(5, 384, (n,)).tolist() for slot, n in slots.items()}
    keys = {}
    unheld = 2 * runner.shapes.blocks_for(runner.shapes.cache_len)  # fill_slot's first block of slot 2
    for drafting in (True, False):
        clear(runner.slots.draft_cache)
        for slot, prompt in prompts.items():
            fill_slot(runner, prompt, slot=slot, positions=256)
        for drafting_step in [drafting] * 20 + [True]:
            kv_len = runner.shapes.kv_len_for(int(runner.state.pos[:4].max()))
            runner.run_step(4, kv_len, False, 3 if drafting_step else 0)
        keys[drafting] = {slot: draft_keys(runner, n + 20, slot) for slot, n in slots.items()}
        for slot in slots:
            release_slot(runner, slot)
    assert not runner.slots.draft_cache.layers[0][0][unheld].any()
    for slot in slots:
        for got, want in zip(keys[False][slot], keys[True][slot], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_a_released_requests_deferred_keys_are_never_written(pair):
    """A request that ends after steps without drafts leaves entries in the ring; its slot's next request
    holds the same blocks (fill_slot), and a pass after it comes in must not write the old request's keys
    into them: the next request's draft cache stays empty past its own prompt and drafting step."""
    target, draft = pair
    llm = LLM(target, dtype="float32", max_batch=1, max_seq_len=256, draft=draft, num_draft_tokens=3)
    runner = llm.runner
    fill_slot(runner, torch.randint(5, 384, (40,)).tolist(), positions=256)
    for _ in range(5):  # entries at positions 40..44
        runner.run_step(1, runner.shapes.kv_len_for(int(runner.state.pos[0])), False, 0)
    release_slot(runner)
    clear(runner.slots.draft_cache)
    fill_slot(runner, torch.randint(5, 384, (10,)).tolist(), positions=256)
    runner.run_step(1, runner.shapes.kv_len_for(int(runner.state.pos[0])), False, 3)  # flushes first
    keys, values = draft_keys(runner, 64)
    assert keys[:10].any() and values[:10].any()  # the new prompt's
    assert not keys[20:].any() and not values[20:].any()


@torch.inference_mode()
def test_a_trees_step_without_drafts_leaves_copies_of_the_bonus_token(pair):
    """After a tree step (its nodes below the root's children too), a step that drafts nothing leaves the
    next tree as N - 1 copies of its bonus token, each a child of the root."""
    target, draft = pair
    llm = LLM(target, dtype="float32", max_batch=1, max_seq_len=256, draft=draft, num_draft_tokens=3,
              speculative_eagle_topk=2, speculative_num_draft_tokens=6)  # fmt: skip
    runner, state = llm.runner, llm.runner.state
    fill_slot(runner, torch.randint(5, 384, (30,)).tolist(), positions=256)
    for k in (3, 0):
        out = runner.run_step(1, runner.shapes.kv_len_for(int(state.pos[0])), False, k)[0].tolist()
        assert state.parents[0].any() == (k > 0)
    assert out[-1] == 0 and state.pending[0].tolist() == [out[0]] * 6


@pytest.mark.parametrize("drafting", ["eagle3", "ngram", "eagle3+ngram", "tree"])
def test_greedy_output_is_plain_whichever_steps_draft(pair, drafting):
    """Batch 1 and 4; the steps that draft nothing are forced at random (a tree's step without drafts leaves
    copies of the bonus token as the next tree's nodes)."""
    target, draft = pair
    spec = {
        "eagle3": dict(draft=draft),
        "ngram": dict(speculative_method="ngram"),
        "eagle3+ngram": dict(draft=draft, prompt_lookup_max=3),
        "tree": dict(draft=draft, speculative_eagle_topk=2, speculative_num_draft_tokens=6),
    }[drafting]
    llm = LLM(target, dtype="float32", max_batch=4, num_draft_tokens=3, **spec)
    plain = LLM(target, dtype="float32", max_batch=4)
    llm.engine.scheduler.draft_length.choose = lambda rows, slots, seeded=False, logits=False: (
        3 * int(torch.rand(()) < 0.5)
    )
    prompts = [torch.randint(5, 384, (n,)).tolist() * 2 for n in (13, 3, 22, 8)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    expected = plain.generate(prompts, params)
    for batch in ([prompts[0]], prompts):
        for prompt, got, want in zip(batch, llm.generate(batch, params), expected, strict=False):
            assert greedy_divergence_is_a_near_tie(plain.model, prompt, got.token_ids, want.token_ids)
            assert 0 < got.draft_steps < got.decode_steps


def test_the_scheduler_times_each_steps_path(pair):
    """Through the engine: a greedy request's steps are timed on the argmax path, a sampled one's (alone
    in its batch) on the logits path alone."""
    target, draft = pair
    llm = LLM(target, dtype="float32", max_batch=1, draft=draft, num_draft_tokens=3, compile=False)
    prompt = torch.randint(5, 384, (12,)).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))
    timed = llm.engine.scheduler.draft_length.seconds
    assert timed and {path for _, _, path in timed} == {False}
    argmax = {key: len(times) for key, times in timed.items()}
    llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0))
    assert {path for _, _, path in timed} == {False, True}
    assert {key: len(times) for key, times in timed.items() if not key[2]} == argmax
