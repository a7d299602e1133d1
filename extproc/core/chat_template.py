"""Counting a chat request's input the way the model server does: by rendering the model's chat
template and counting the tokens of the text.

vLLM (and transformers' ``apply_chat_template``) turn a chat request into one prompt string by
rendering the Jinja ``chat_template`` of the model's ``tokenizer_config.json`` with the
conversation, the tool definitions, ``add_generation_prompt=True`` and the tokenizer's special
tokens (``bos_token``, ``eos_token``, ...), then encode that string without adding special tokens;
special-token text in it (``<|user|>``) becomes one token each.  :func:`count_with_template` does
the same over a compiled template (:class:`ChatTemplate`, built by :mod:`extproc.tokenizers`; this
module never imports Jinja and never reads a file).

The conversation is built from the request body as vLLM builds it:

* chat completions: each message's ``content`` becomes a list of ``{"type": "text", ...}`` parts
  when the template loops over ``message['content']`` (vLLM's "openai" content format), else the
  text parts joined with ``"\\n"`` (its "string" format); assistant ``tool_calls`` keep their
  shape with JSON ``arguments`` parsed into objects; a ``tool`` message's text parts are joined;
* Responses: ``instructions`` as a system message, a string ``input`` as a user message, and
  message items (``input_text`` / ``output_text`` parts) by their role;
* Messages: ``system`` as a system message, text blocks as message content.

Media parts cannot be rendered the way a multimodal model expands them, so each image, audio
or file part costs the spec's flat figure on top of the rendered text (an ``{"type": "image"}``
part is handed to "openai"-format templates, as vLLM does).  Anything else the template path
does not model (Responses tool items, Messages ``tool_use`` blocks, unknown part types, a
template that raises) returns None, and the caller counts with the OpenAI framing formula.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import orjson

from extproc.core.tokens import TokenCounter, TokenizerSpec

__all__ = [
    "ChatTemplate",
    "ContentFormat",
    "TemplateRenderer",
    "chat_conversation",
    "count_templated",
    "count_with_template",
    "function_tools",
    "messages_conversation",
    "responses_conversation",
    "template_of",
]

ContentFormat = Literal["string", "openai"]

#: Names the renderer sets itself; a request's ``chat_template_kwargs`` cannot override them.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
_AUDIO_PARTS = frozenset({"input_audio", "audio", "audio_url"})
_FILE_PARTS = frozenset({"file", "input_file"})


class TemplateRenderer(Protocol):
    """A compiled template (``jinja2.Template`` is one)."""

    def render(self, *args: Any, **kwargs: Any) -> str:
        """The text for the given variables."""
        ...


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A model's compiled chat template and what it is rendered with.

    ``variables``: the tokenizer's special tokens as strings (``bos_token``, ``eos_token``, ...),
    passed to every rendering.  ``content_format``: whether the template iterates over a
    message's content parts (``openai``) or reads it as one string (``string``).
    """

    renderer: TemplateRenderer
    content_format: ContentFormat
    variables: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""


def template_of(counter: TokenCounter) -> ChatTemplate | None:
    """The chat template a counter was loaded with (Hugging Face directories only), or None."""
    template = getattr(counter, "chat_template", None)
    return template if isinstance(template, ChatTemplate) else None


class _Unsupported(Exception):  # internal signal, never escapes this module
    """The body has a shape the template path does not model: use the formula."""


@dataclass(slots=True)
class _Media:
    """Flat media costs met while building the conversation."""

    tokens: int = 0


def _parts(content: Any, spec: TokenizerSpec, media: _Media) -> list[dict[str, Any]]:
    """``content`` (a string, a list of parts or None) as vLLM's list of text / media parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _Unsupported
    out: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, str):
            out.append({"type": "text", "text": part})
            continue
        if not isinstance(part, Mapping):
            raise _Unsupported
        kind = part.get("type")
        field_name = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if field_name is not None:
            text = part.get(field_name)
            if not isinstance(text, str):
                raise _Unsupported
            out.append({"type": "text", "text": text})
        elif kind in _IMAGE_PARTS:
            media.tokens += spec.image_tokens
            out.append({"type": "image"})
        elif kind in _AUDIO_PARTS:
            media.tokens += spec.audio_tokens
            out.append({"type": "audio"})
        elif kind in _FILE_PARTS:
            media.tokens += spec.file_tokens
        else:
            raise _Unsupported
    return out


def _content(parts: list[dict[str, Any]], fmt: ContentFormat) -> Any:
    if fmt == "openai":
        return parts
    return "\n".join(p["text"] for p in parts if p.get("type") == "text")


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    """Assistant tool calls with JSON ``arguments`` parsed (what tool-aware templates expect)."""
    if not isinstance(calls, list):
        raise _Unsupported
    out: list[dict[str, Any]] = []
    for call in calls:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise _Unsupported
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                parsed = {}
            function["arguments"] = parsed if isinstance(parsed, dict | list) else {}
        elif not isinstance(arguments, dict | list):
            function["arguments"] = {}
        out.append({**call, "function": function})
    return out


def chat_conversation(
    body: Mapping[str, Any], fmt: ContentFormat, spec: TokenizerSpec
) -> tuple[list[dict[str, Any]], int] | None:
    """The conversation a ``/v1/chat/completions`` body renders from, and its flat media
    tokens; None when the body has a shape this path does not model."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    media = _Media()
    out: list[dict[str, Any]] = []
    try:
        for message in messages:
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                return None
            role = message["role"]
            parts = _parts(message.get("content"), spec, media)
            msg: dict[str, Any] = {"role": role, "content": _content(parts, fmt)}
            if role == "tool":
                if all(p.get("type") == "text" for p in parts):
                    msg["content"] = "\n".join(p["text"] for p in parts)
                if message.get("tool_call_id") is not None:
                    msg["tool_call_id"] = message["tool_call_id"]
            if role == "assistant" and message.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(message["tool_calls"])
            for key in ("reasoning", "reasoning_content"):
                if role == "assistant" and isinstance(message.get(key), str):
                    msg[key] = message[key]
            if isinstance(message.get("name"), str):
                msg["name"] = message["name"]
            out.append(msg)
    except _Unsupported:
        return None
    return out, media.tokens


def responses_conversation(
    body: Mapping[str, Any], fmt: ContentFormat, spec: TokenizerSpec
) -> tuple[list[dict[str, Any]], int] | None:
    """The conversation of a ``/v1/responses`` body (instructions, string input, message
    items); None for tool-call, reasoning or other items."""
    media = _Media()
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    try:
        if instructions is not None:
            if not isinstance(instructions, str):
                return None
            out.append(
                {"role": "system", "content": _content(_parts(instructions, spec, media), fmt)}
            )
        items = body.get("input")
        if isinstance(items, str):
            out.append({"role": "user", "content": _content(_parts(items, spec, media), fmt)})
        elif isinstance(items, list):
            for raw in items:
                item = {"role": "user", "content": raw} if isinstance(raw, str) else raw
                if not isinstance(item, Mapping):
                    return None
                kind = item.get("type")
                role = item.get("role")
                if kind not in (None, "message") or not isinstance(role, str):
                    return None
                parts = _parts(item.get("content"), spec, media)
                out.append({"role": role, "content": _content(parts, fmt)})
        elif items is not None:
            return None
    except _Unsupported:
        return None
    return out, media.tokens


def messages_conversation(
    body: Mapping[str, Any], fmt: ContentFormat, spec: TokenizerSpec
) -> tuple[list[dict[str, Any]], int] | None:
    """The conversation of a ``/v1/messages`` body (system prompt and text / image blocks);
    None for tool-use, tool-result, thinking or document blocks."""
    media = _Media()
    out: list[dict[str, Any]] = []
    try:
        system = body.get("system")
        if system is not None:
            out.append({"role": "system", "content": _content(_blocks(system, spec, media), fmt)})
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        for message in messages:
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                return None
            parts = _blocks(message.get("content"), spec, media)
            out.append({"role": message["role"], "content": _content(parts, fmt)})
    except _Unsupported:
        return None
    return out, media.tokens


def _blocks(content: Any, spec: TokenizerSpec, media: _Media) -> list[dict[str, Any]]:
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping) and block.get("type") not in ("text", "image"):
                raise _Unsupported
    return _parts(content, spec, media)


def _tools(value: Any) -> list[Any] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise _Unsupported
    return value


def function_tools(value: Any, api: Literal["responses", "messages"]) -> list[Any] | bool | None:
    """A Responses or Messages ``tools`` list in the chat-completions shape a template reads
    (``{"type": "function", "function": {name, description, parameters}}``); None when there
    are none, False when one is not a function tool (built-in tools: use the formula)."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        return False
    out: list[Any] = []
    for tool in value:
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            return False
        if api == "responses" and tool.get("type") != "function":
            return False
        if api == "messages" and tool.get("type") not in (None, "custom"):
            return False
        function: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        params = tool.get("parameters" if api == "responses" else "input_schema")
        if params is not None:
            function["parameters"] = params
        out.append({"type": "function", "function": function})
    return out


def count_templated(
    template: ChatTemplate,
    conversation: tuple[list[dict[str, Any]], int] | None,
    body: Mapping[str, Any],
    counter: TokenCounter,
    *,
    tools: Any = None,
) -> int | None:
    """Tokens of ``conversation`` rendered with ``template`` (plus its flat media tokens), or
    None when there is no conversation or the template cannot render it (it raised: vLLM
    would refuse the request too, and the caller's formula decides)."""
    if conversation is None:
        return None
    messages, media_tokens = conversation
    try:
        tool_list = _tools(tools)
    except _Unsupported:
        return None
    variables: dict[str, Any] = dict(template.variables)
    extra = body.get("chat_template_kwargs")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            if isinstance(key, str) and key not in _RESERVED and key not in variables:
                variables[key] = value
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        add_generation_prompt = True
    try:
        text = template.renderer.render(
            messages=messages,
            tools=tool_list,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except RecursionError:
        return None
    except Exception:  # any template failure (TemplateError, TypeError, ...)
        return None
    if not isinstance(text, str):
        return None
    return counter.count(text) + media_tokens


_CONVERSATIONS = {
    "chat": chat_conversation,
    "responses": responses_conversation,
    "messages": messages_conversation,
}


def count_with_template(
    api: Literal["chat", "responses", "messages"],
    body: Mapping[str, Any],
    counter: TokenCounter,
    spec: TokenizerSpec,
) -> int | None:
    """The input tokens of an ``api`` request body counted by rendering the counter's chat
    template, or None when the counter has no template, the body has a shape (or, for Responses
    and Messages, a tool) this path does not model, or the template cannot render it: the
    caller then counts with its API's framing formula."""
    template = getattr(counter, "chat_template", None)  # template_of, without its call
    if not isinstance(template, ChatTemplate):
        return None
    tools: Any = body.get("tools")
    if api != "chat":
        tools = function_tools(tools, api)
        if tools is False:
            return None
    conversation = _CONVERSATIONS[api](body, template.content_format, spec)
    return count_templated(template, conversation, body, counter, tools=tools)
