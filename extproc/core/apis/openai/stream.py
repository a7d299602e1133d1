"""The OpenAI stream reader: what one ``data:`` event of a ``/v1/chat/completions`` or
``/v1/completions`` stream says (:func:`parse_event_data`).

Output text is taken from chat ``delta.content``, ``delta.reasoning_content``,
``delta.reasoning``, ``delta.refusal``, ``delta.tool_calls[*].function.arguments`` (and the
legacy ``delta.function_call.arguments``), and from completions ``choices[*].text``.  Tool and
function *names* are not counted: they are short, come from the request's tool list, and
OpenAI bills the call's arguments, not its name.  A ``content`` given as a list of parts
contributes the ``text`` of each part.

Structure is checked, leaves are read leniently: data that is not JSON, not an object, a
``choices`` that is neither absent, null nor a list, or a choice that is not an object raises
:class:`MalformedChunk`; a missing or non-integer ``index`` means choice 0, and null or
non-string text fields, a null ``delta`` and a non-list ``tool_calls`` are skipped.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from extproc.core.chunks import DONE, MalformedChunk, StreamChunk, Usage, detail
from extproc.core.values import is_int

_DELTA_TEXT_KEYS: Final = ("content", "reasoning_content", "reasoning", "refusal")
#: The text keys after ``content`` (read first, apart: nearly every delta has only it).
_OTHER_TEXT_KEYS: Final = _DELTA_TEXT_KEYS[1:]
_loads: Final = orjson.loads


def _usage(value: object) -> Usage | None:
    """``Usage`` when prompt and completion counts are ints; a missing total is their sum."""
    if not isinstance(value, dict):
        return None
    prompt = value.get("prompt_tokens")
    completion = value.get("completion_tokens")
    if not (is_int(prompt) and is_int(completion)):
        return None
    assert isinstance(prompt, int)
    assert isinstance(completion, int)
    total = value.get("total_tokens")
    if not (isinstance(total, int) and is_int(total)):
        total = prompt + completion
    return Usage(
        prompt,
        completion,
        total,
        cached_input_tokens=detail(value, "prompt_tokens_details", "cached_tokens"),
        reasoning_tokens=detail(value, "completion_tokens_details", "reasoning_tokens"),
    )


def _add_text(texts: list[tuple[int, str]], index: int, value: object) -> None:
    if isinstance(value, str):
        if value:
            texts.append((index, value))
    elif isinstance(value, list):
        for part in value:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str) and text:
                    texts.append((index, text))


def _add_delta(texts: list[tuple[int, str]], index: int, delta: dict[str, Any]) -> None:
    content = delta.get("content")
    if content is not None:
        if type(content) is str:  # the usual delta: one piece of text
            if content:
                texts.append((index, content))
        else:
            _add_text(texts, index, content)
        if len(delta) == 1:
            return
    elif not delta:
        return
    for key in _OTHER_TEXT_KEYS:
        value = delta.get(key)
        if value is not None:
            _add_text(texts, index, value)
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            if isinstance(call, dict):
                function = call.get("function")
                if isinstance(function, dict):
                    arguments = function.get("arguments")
                    if isinstance(arguments, str) and arguments:
                        texts.append((index, arguments))
    legacy = delta.get("function_call")
    if isinstance(legacy, dict):
        arguments = legacy.get("arguments")
        if isinstance(arguments, str) and arguments:
            texts.append((index, arguments))


def parse_event_data(data: str) -> StreamChunk:
    """Parse the ``data`` of one stream event; raise :class:`MalformedChunk` if it is unusable.

    The per-chunk hot path of every OpenAI stream: exact-type checks first (``orjson`` makes
    exact ``dict``/``list``/``str``/``int``), the general checks only when they fail.
    """
    if data == DONE or data.strip() == DONE:
        return StreamChunk(done=True)
    try:
        obj = _loads(data)
    except orjson.JSONDecodeError as exc:
        raise MalformedChunk(f"event data is not JSON: {exc}") from None
    if type(obj) is not dict:
        raise MalformedChunk(f"event data is a JSON {type(obj).__name__}, not an object")
    chunk = StreamChunk()
    error = obj.get("error")
    if error is not None:
        if isinstance(error, dict):
            chunk.error = error
        elif isinstance(error, str):
            chunk.error = {"message": error}
    choices = obj.get("choices")
    if choices is None:
        choices = ()
    elif type(choices) is not list:
        raise MalformedChunk(f"choices is a JSON {type(choices).__name__}, not a list")
    texts = chunk.texts
    for choice in choices:
        if type(choice) is not dict:
            raise MalformedChunk(f"a choice is a JSON {type(choice).__name__}, not an object")
        raw_index = choice.get("index")
        index = raw_index if type(raw_index) is int else 0
        delta = choice.get("delta")
        if type(delta) is dict:
            _add_delta(texts, index, delta)
        text = choice.get("text")
        if text is not None:
            _add_text(texts, index, text)
        reason = choice.get("finish_reason")
        if type(reason) is str:
            chunk.finish_reasons.append((index, reason))
    usage = obj.get("usage")
    if usage is not None:
        chunk.usage = _usage(usage)
        chunk.is_usage_only = chunk.usage is not None and not choices
    return chunk
