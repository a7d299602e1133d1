"""Chat completions and completions rebuilt from their streams (the exact path).

Chat: ``chat.completion.chunk`` objects become one ``chat.completion``: choices by
``index``, ``delta.role``/``content``/``refusal``/``reasoning_content``/``reasoning``
concatenated into ``message``, ``delta.tool_calls`` merged by their ``index`` (``id``,
``type`` and ``function.name`` from the first delta that carries them, ``arguments``
concatenated; the legacy ``function_call`` likewise), ``logprobs.content``/``refusal``
lists joined, the last non-null ``finish_reason`` (and vLLM's ``stop_reason``); ``id``,
``created``, ``model``, ``system_fingerprint``, ``service_tier`` from the chunks; the last
``usage`` (the final usage chunk; with continuous usage every chunk has a running one).
Completions: ``text`` concatenated per choice, the four ``logprobs`` lists joined.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from extproc.core.apis.reassembly import BufferedStream, Event, concat, error_of
from extproc.core.values import is_int

_TOP: Final = ("id", "created", "model", "system_fingerprint", "service_tier")
_MESSAGE_TEXT: Final = ("content", "refusal", "reasoning_content", "reasoning")
_CHAT_LOGPROBS: Final = ("content", "refusal")
_COMPLETION_LOGPROBS: Final = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _index(choice: dict[str, Any]) -> int:
    i = choice.get("index")
    return i if isinstance(i, int) and is_int(i) else 0


def _top(out: dict[str, Any], chunk: dict[str, Any]) -> None:
    for key in _TOP:
        value = chunk.get(key)
        if value is not None:
            out[key] = value
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        out["usage"] = usage


def _choices(out: dict[str, Any], events: list[Event]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each chunk's top-level fields into ``out``; its well-formed choices with their index."""
    for _, chunk in events:
        _top(out, chunk)
        raw = chunk.get("choices")
        if not isinstance(raw, list):
            continue
        for choice in raw:
            if isinstance(choice, dict):
                yield _index(choice), choice


def _join_logprobs(st: dict[str, Any], lp: object, keys: tuple[str, ...]) -> None:
    """A chunk's ``logprobs`` lists appended to the choice's (in place: linear in the
    stream's length)."""
    if not isinstance(lp, dict):
        return
    have = st["logprobs"] if isinstance(st["logprobs"], dict) else {}
    for key in keys:
        part = lp.get(key)
        if isinstance(part, list):
            cur = have.get(key)
            if isinstance(cur, list):
                cur.extend(part)
            else:
                have[key] = list(part)
    st["logprobs"] = have


def _ending(st: dict[str, Any], choice: dict[str, Any]) -> None:
    if choice.get("finish_reason") is not None:
        st["finish_reason"] = choice["finish_reason"]
    if "stop_reason" in choice:
        st["stop_reason"] = choice["stop_reason"]


def _merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    i = delta.get("index")
    i = i if isinstance(i, int) and is_int(i) else len(calls)
    call = calls.get(i)
    if call is None:
        call = calls[i] = {
            "id": None,
            "type": "function",
            "function": {"name": "", "arguments": ""},
        }
    if isinstance(delta.get("id"), str):
        call["id"] = delta["id"]
    if isinstance(delta.get("type"), str):
        call["type"] = delta["type"]
    fn = delta.get("function")
    if isinstance(fn, dict):
        concat(call["function"], "name", fn.get("name"))
        concat(call["function"], "arguments", fn.get("arguments"))


def assemble_chat(events: list[Event]) -> dict[str, Any]:
    """One ``chat.completion`` from the stream's chunks."""
    err = error_of(events)
    if err is not None:
        return err
    out: dict[str, Any] = {"id": "", "object": "chat.completion", "created": 0, "model": ""}
    choices: dict[int, dict[str, Any]] = {}
    tools: dict[int, dict[int, dict[str, Any]]] = {}
    for i, choice in _choices(out, events):
        st = choices.get(i)
        if st is None:
            st = choices[i] = {
                "index": i,
                "message": {"role": "assistant", "content": None},
                "logprobs": None,
                "finish_reason": None,
            }
        msg = st["message"]
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if isinstance(delta.get("role"), str):
                msg["role"] = delta["role"]
            for key in _MESSAGE_TEXT:
                concat(msg, key, delta.get(key))
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                merged = tools.setdefault(i, {})
                for call in calls:
                    if isinstance(call, dict):
                        _merge_tool_call(merged, call)
            fc = delta.get("function_call")
            if isinstance(fc, dict):
                legacy = msg.setdefault("function_call", {"name": "", "arguments": ""})
                concat(legacy, "name", fc.get("name"))
                concat(legacy, "arguments", fc.get("arguments"))
        _join_logprobs(st, choice.get("logprobs"), _CHAT_LOGPROBS)
        _ending(st, choice)
    for i, merged in tools.items():
        choices[i]["message"]["tool_calls"] = [merged[k] for k in sorted(merged)]
    out["choices"] = [choices[k] for k in sorted(choices)]
    return out


def assemble_completion(events: list[Event]) -> dict[str, Any]:
    """One ``text_completion`` from the stream's chunks."""
    err = error_of(events)
    if err is not None:
        return err
    out: dict[str, Any] = {"id": "", "object": "text_completion", "created": 0, "model": ""}
    choices: dict[int, dict[str, Any]] = {}
    for i, choice in _choices(out, events):
        st = choices.get(i)
        if st is None:
            st = choices[i] = {"index": i, "text": "", "logprobs": None, "finish_reason": None}
        concat(st, "text", choice.get("text"))
        _join_logprobs(st, choice.get("logprobs"), _COMPLETION_LOGPROBS)
        _ending(st, choice)
    out["choices"] = [choices[k] for k in sorted(choices)]
    return out


def chat_reassembler() -> BufferedStream:
    """A fresh chat reassembler."""
    return BufferedStream(assemble_chat)


def completion_reassembler() -> BufferedStream:
    """A fresh completions reassembler."""
    return BufferedStream(assemble_completion)
