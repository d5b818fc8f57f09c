"""The target writes the responses its draft learns from (the EAGLE-3 recipe): prompts from chat
conversations rendered with the target's own chat template, or windows cut from text, completed by
redline's engine with many slots (continuous batching).

Greedy by default: the draft is measured and served on greedy decoding, where what it must predict is
the target's argmax after the target's own greedy text, so the training contexts are exactly the ones
it meets; the soft targets still carry the target's whole distribution at every position.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from tqdm import tqdm

from redline.engine.llm import LLM
from redline.engine.request import Request
from redline.sampling import SamplingParams
from redline.tokenizer import Tokenizer
from redline.train.features import Sample


def first_turn(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """The messages up to and including the first user message ([] when there is none)."""
    for i, m in enumerate(messages):
        if m["role"] == "user":
            return [dict(m) for m in messages[: i + 1]]
    return []


def chat_prompts(
    tokenizer: Tokenizer, conversations: Iterable[Sequence[dict[str, str]]], max_len: int
) -> list[tuple[int, list[int]]]:
    """(conversation index, prompt ids) for each conversation's first user turn rendered with the chat
    template and the assistant prefix; prompts longer than max_len tokens are left out."""
    prompts = []
    for i, messages in enumerate(conversations):
        turn = first_turn(messages)
        if turn and turn[-1]["content"].strip():
            ids = tokenizer.encode_chat(turn)
            if len(ids) <= max_len:
                prompts.append((i, ids))
    return prompts


def regenerate(
    llm: LLM,
    prompts: list[list[int]],
    params: Callable[[int], SamplingParams],  # prompt index -> its sampling parameters
    done: dict[int, Sample],  # prompt index -> sample, already generated (resume); filled in place
    deadline: float | None = None,  # time.perf_counter() after which no request starts
    save: Callable[[], None] = lambda: None,
    save_every_s: float = 30.0,
) -> dict[int, Sample]:
    """Completes the prompts not in `done`, in order, keeping every slot busy. At the deadline requests in
    flight are cancelled and their partial responses kept (a shorter sample of the same text); those
    not yet started are left undone."""
    todo = [i for i in range(len(prompts)) if i not in done]
    queue_depth = 2 * llm.config.scheduler.slots
    running: dict[int, Request] = {}
    engine = llm.engine
    bar = tqdm(total=len(prompts), initial=len(done), desc="target answers", unit="seq", dynamic_ncols=True)
    tokens, start, last_save = 0, time.perf_counter(), time.perf_counter()

    def record(i: int) -> None:
        nonlocal tokens
        request = running.pop(i)
        if request.finish_reason == "error":
            raise RuntimeError(f"the target failed on prompt {i}: {request.error}")
        if not request.output_ids:  # cancelled before its prefill
            return
        done[i] = Sample(prompts[i] + request.output_ids, len(prompts[i]))
        tokens += len(request.output_ids)
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")

    while todo or running:
        out_of_time = deadline is not None and time.perf_counter() > deadline
        while todo and len(running) < queue_depth and not out_of_time:
            i = todo.pop(0)
            running[i] = llm.make_request(prompts[i], params(i))
            engine.add(running[i])
        if out_of_time:
            for i in list(running):
                engine.cancel(running[i])
                record(i)
            break
        engine.step()
        for i in [i for i, r in running.items() if r.finished]:
            record(i)
        if time.perf_counter() - last_save > save_every_s:
            save()
            last_save = time.perf_counter()
    bar.close()
    save()
    return done
