"""Parsing and validating /v1/completions and /v1/chat/completions bodies into engine inputs.

Every check names the offending field. Unknown fields are ignored (clients send many: user, metadata,
store, ...); fields whose non-default values would change the output and that redline cannot honour
yet (suffix, logit_bias, response_format, tools, guided decoding, best_of > n) are rejected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from redline.sampling import MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_TOP_K, SamplingParams
from redline.server.errors import APIError, invalid

MAX_TEMPERATURE = 2.0  # OpenAI's range: [0, 2]
MAX_STOP_STRINGS = 16  # lm-eval sends a task's stop sequences and the eos string: humaneval's are 6
MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass
class Parsed:
    prompts: list[str | list[int]] | None  # completions: one or more prompts, text or token ids
    messages: list[dict[str, str]] | None  # chat
    params: SamplingParams  # logprobs set when asked; prompt_logprobs with echo
    stream: bool
    include_usage: bool
    max_tokens_given: bool
    n: int = 1  # samples of each prompt, as choices prompt_index * n + sample_index
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


def _number(data: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(key, f"must be a number, got {type(value).__name__}")
    if value != value or value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise invalid(key, f"must be in {bound}, got {value}")
    return float(value)


def _integer(data: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # 1.0 is an integer to JSON Schema
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(key, f"must be an integer, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        raise invalid(key, f"must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def _boolean(data: dict, key: str, default: bool = False) -> bool:
    value = data.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(key, f"must be true or false, got {type(value).__name__}")
    return value


def _stop(data: dict) -> list[str]:
    stop = data.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} non-empty strings")
    return stops


def _n(data: dict) -> int:
    n = _integer(data, "n", 1, MAX_N) or 1
    best_of = _integer(data, "best_of", 1)
    if best_of not in (None, n):
        raise invalid("best_of", f"is not supported other than equal to n ({n}), got {best_of}")
    return n


def _unsupported(data: dict, chat: bool) -> None:
    refused = ["tools", "functions", "logit_bias", "suffix", "prompt_logprobs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "structured_outputs"]  # fmt: skip
    if chat:
        refused.append("echo")  # OpenAI's chat API has none
    for key in refused:
        if data.get(key) not in (None, False, 0, [], {}, ""):
            raise invalid(key, "is not supported")
    if data.get("length_penalty") not in (None, 1):
        raise invalid("length_penalty", "is not supported (use 1)")
    if data.get("response_format") not in (None, {"type": "text"}):
        raise invalid("response_format", 'is not supported (only {"type": "text"})')
    if data.get("tool_choice") not in (None, "none"):
        raise invalid("tool_choice", 'is not supported (only "none")')


def _sampling(
    data: dict, max_tokens: int, stops: list[str], logprobs: int | None, echo: bool
) -> SamplingParams:
    """With echo, the prompt's logprobs are computed when the tokens' are asked for, or max_tokens is 0."""
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid("seed", f"must be an integer, got {type(seed).__name__}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(data, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=_number(data, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_integer(data, "top_k", 0, MAX_TOP_K) or 0,
        min_p=_number(data, "min_p", 0.0, 0.0, 1.0),
        seed=seed,
        stop=stops,
        ignore_eos=_boolean(data, "ignore_eos"),
        presence_penalty=_number(data, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(data, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        repetition_penalty=_number(
            data, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, low_open=True
        ),
        logprobs=logprobs,
        prompt_logprobs=(logprobs or 0) if echo and (logprobs is not None or max_tokens == 0) else None,
    )


def _logprobs(data: dict, chat: bool) -> int | None:
    """Top alternatives per token, or None: completions' `logprobs: N`, chat's `logprobs: true` with
    `top_logprobs: N`."""
    if not chat:
        value = data.get("logprobs")
        if isinstance(value, bool):
            raise invalid(
                "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] on completions, got {value}"
            )
        return _integer(data, "logprobs", 0, MAX_LOGPROBS)
    top = _integer(data, "top_logprobs", 0, MAX_LOGPROBS)
    if not _boolean(data, "logprobs"):
        if top is not None:
            raise invalid("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def _stream_options(data: dict, stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    if not stream:
        raise invalid("stream_options", "is only allowed with stream: true")
    return _boolean(options, "include_usage")


def _max_tokens(data: dict, keys: tuple[str, ...], context: int, low: int) -> int | None:
    for key in keys:
        value = _integer(data, key, low, context)
        if value is not None:
            return value
    return None


def _prompts(data: dict, vocab_size: int) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a list of either (up to MAX_PROMPTS)."""
    prompt = data.get("prompt")
    if prompt is None:
        raise invalid("prompt", "is required")
    batch = isinstance(prompt, list) and any(isinstance(p, str | list) for p in prompt)
    prompts = prompt if batch else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise invalid("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}")
    return [
        _one_prompt(p, "prompt" if not batch else f"prompt[{i}]", vocab_size) for i, p in enumerate(prompts)
    ]


def _one_prompt(prompt: object, name: str, vocab_size: int) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid(name, "must not be empty")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise invalid(name, f"token ids must be in [0, {vocab_size})")
        return prompt
    raise invalid(name, "must be a non-empty string or list of token ids, or a list of those")


def _messages(data: dict) -> list[dict[str, str]]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", "must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise invalid(f"messages[{i}].content", "only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def parse_request(data: dict, chat: bool, served_model: str, context: int, vocab_size: int) -> Parsed:
    model = data.get("model")
    if not isinstance(model, str):
        raise invalid("model", "is required and must be a string")
    _model_if_given(data, served_model)
    _unsupported(data, chat)
    stream = _boolean(data, "stream")
    echo = _boolean(data, "echo")
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = _max_tokens(
        data, keys, context, low=0 if echo else 1
    )  # echo: max_tokens 0 scores the prompt
    default = context if chat else 16  # OpenAI: chat runs to the context limit, completions default to 16
    max_tokens_or_default = default if max_tokens is None else max_tokens
    params = _sampling(data, max_tokens_or_default, _stop(data), _logprobs(data, chat), echo)
    return Parsed(
        prompts=None if chat else _prompts(data, vocab_size),
        messages=_messages(data) if chat else None,
        params=params,
        stream=stream,
        include_usage=_stream_options(data, stream),
        max_tokens_given=max_tokens is not None,
        n=_n(data),
        echo=echo,
    )


@dataclass
class TokenizeRequest:
    """POST /tokenize (as vLLM serves it): a prompt, or chat messages to render with the template."""

    prompt: str | None
    messages: list[dict[str, str]] | None
    add_special_tokens: bool
    add_generation_prompt: bool


def _model_if_given(data: dict, served_model: str) -> None:
    model = data.get("model")
    if model is not None and model != served_model:
        raise APIError(404, f"model {model!r} does not exist; this server serves {served_model!r}", "model",
                       "not_found_error")  # fmt: skip


def parse_tokenize(data: dict, served_model: str) -> TokenizeRequest:
    _model_if_given(data, served_model)
    if "messages" in data:
        return TokenizeRequest(None, _messages(data), False, _boolean(data, "add_generation_prompt", True))
    prompt = data.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt", "is required and must be a string (or give messages)")
    return TokenizeRequest(prompt, None, _boolean(data, "add_special_tokens", True), False)


def parse_detokenize(data: dict, served_model: str, vocab_size: int) -> list[int]:
    """POST /detokenize: the token ids to turn back into text."""
    _model_if_given(data, served_model)
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
        raise invalid("tokens", "is required and must be a list of token ids")
    if any(not 0 <= t < vocab_size for t in tokens):
        raise invalid("tokens", f"token ids must be in [0, {vocab_size})")
    return tokens
