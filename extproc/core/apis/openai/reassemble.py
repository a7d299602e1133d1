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


def _top(out: dict[str, Any], events: list[Event]) -> None:
    """The top-level fields into ``out``: each one's last non-null value, and the last
    ``usage`` object (read from the end: the last chunks carry them, so this is a few
    lookups, not a few per chunk)."""
    for key in _TOP:
        for _, chunk in reversed(events):
            value = chunk.get(key)
            if value is not None:
                out[key] = value
                break
    for _, chunk in reversed(events):
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            out["usage"] = usage
            break


def _choices(events: list[Event]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each chunk's well-formed choices with their index."""
    for _, chunk in events:
        raw = chunk.get("choices")
        if not isinstance(raw, list):
            continue
        for choice in raw:
            if isinstance(choice, dict):
                yield _index(choice), choice


class _Texts:
    """A choice's string fields, their pieces kept in lists and joined once at the end (one
    copy of the text, not one per piece)."""

    __slots__ = ("_into", "_parts")

    def __init__(self, into: dict[str, Any]) -> None:
        self._into = into
        self._parts: dict[str, list[str]] = {}

    def add(self, key: str, value: object) -> None:
        """Append a string piece (non-strings ignored); the key takes its place in the
        object at its first piece."""
        if isinstance(value, str):
            parts = self._parts.get(key)
            if parts is None:
                parts = self._parts[key] = [self._into.get(key) or ""]
                self._into.setdefault(key, None)
            parts.append(value)

    def join(self) -> None:
        """Write the joined strings into the object."""
        for key, parts in self._parts.items():
            self._into[key] = "".join(parts)


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


def _chat_delta(
    msg: dict[str, Any],
    texts: _Texts,
    delta: dict[str, Any],
    tools: dict[int, dict[str, Any]] | None,
) -> dict[int, dict[str, Any]] | None:
    """One chunk's ``delta`` into its choice's message (a delta of content alone, the usual
    chunk, is one append); the choice's tool calls as merged so far."""
    if len(delta) == 1:
        content = delta.get("content")
        if content is not None:
            texts.add("content", content)
            return tools
    if isinstance(delta.get("role"), str):
        msg["role"] = delta["role"]
    for key in _MESSAGE_TEXT:
        texts.add(key, delta.get(key))
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        tools = {} if tools is None else tools
        for call in calls:
            if isinstance(call, dict):
                _merge_tool_call(tools, call)
    fc = delta.get("function_call")
    if isinstance(fc, dict):
        legacy = msg.setdefault("function_call", {"name": "", "arguments": ""})
        concat(legacy, "name", fc.get("name"))
        concat(legacy, "arguments", fc.get("arguments"))
    return tools


def assemble_chat(events: list[Event]) -> dict[str, Any]:
    """One ``chat.completion`` from the stream's chunks."""
    err = error_of(events)
    if err is not None:
        return err
    out: dict[str, Any] = {"id": "", "object": "chat.completion", "created": 0, "model": ""}
    _top(out, events)
    # per choice index: its object, its texts, its tool calls merged by their index
    choices: dict[int, tuple[dict[str, Any], _Texts, list[dict[int, dict[str, Any]] | None]]] = {}
    for i, choice in _choices(events):
        have = choices.get(i)
        if have is None:
            st: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": None},
                "logprobs": None,
                "finish_reason": None,
            }
            have = choices[i] = (st, _Texts(st["message"]), [None])
        st, texts, tools = have
        delta = choice.get("delta")
        if isinstance(delta, dict):
            tools[0] = _chat_delta(st["message"], texts, delta, tools[0])
        lp = choice.get("logprobs")
        if lp is not None:
            _join_logprobs(st, lp, _CHAT_LOGPROBS)
        _ending(st, choice)
    for st, texts, tools in choices.values():
        texts.join()
        if tools[0] is not None:
            st["message"]["tool_calls"] = [tools[0][k] for k in sorted(tools[0])]
    out["choices"] = [choices[k][0] for k in sorted(choices)]
    return out


def assemble_completion(events: list[Event]) -> dict[str, Any]:
    """One ``text_completion`` from the stream's chunks."""
    err = error_of(events)
    if err is not None:
        return err
    out: dict[str, Any] = {"id": "", "object": "text_completion", "created": 0, "model": ""}
    _top(out, events)
    choices: dict[int, tuple[dict[str, Any], _Texts]] = {}
    for i, choice in _choices(events):
        have = choices.get(i)
        if have is None:
            st: dict[str, Any] = {"index": i, "text": "", "logprobs": None, "finish_reason": None}
            have = choices[i] = (st, _Texts(st))
        st, texts = have
        texts.add("text", choice.get("text"))
        lp = choice.get("logprobs")
        if lp is not None:
            _join_logprobs(st, lp, _COMPLETION_LOGPROBS)
        _ending(st, choice)
    for _, texts in choices.values():
        texts.join()
    out["choices"] = [choices[k][0] for k in sorted(choices)]
    return out


def chat_reassembler() -> BufferedStream:
    """A fresh chat reassembler."""
    return BufferedStream(assemble_chat)


def completion_reassembler() -> BufferedStream:
    """A fresh completions reassembler."""
    return BufferedStream(assemble_completion)
