"""Input tokens of an OpenAI chat or completions request by OpenAI's published framing rule
(the fallback when the model has no chat template): message contents, names, tool calls and
definitions, images, audio and files at their flat figures (``TokenizerSpec``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.core.apis.common import count_content_parts
from extproc.core.tokens import (
    PromptShapeError,
    TokenCounter,
    TokenizerSpec,
    json_text,
    require_text,
)

_TEXT_FIELD = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _count_content(content: Any, path: str, counter: TokenCounter, spec: TokenizerSpec) -> int:
    return count_content_parts(
        content,
        path,
        counter,
        spec,
        text_fields=_TEXT_FIELD,
        shape="a string, a list of content parts or null",
    )


def _count_function_call(call: Any, path: str, counter: TokenCounter) -> int:
    if not isinstance(call, Mapping):
        raise PromptShapeError(f"{path} must be an object")
    total = 0
    name = call.get("name")
    if name is not None:
        total += counter.count(require_text(name, f"{path}.name"))
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        total += counter.count(arguments)
    elif isinstance(arguments, Mapping):
        total += counter.count(json_text(arguments))
    elif arguments is not None:
        raise PromptShapeError(f"{path}.arguments must be a string")
    return total


def _count_tool_calls(calls: Any, path: str, counter: TokenCounter) -> int:
    if calls is None:
        return 0
    if not isinstance(calls, list):
        raise PromptShapeError(f"{path} must be a list")
    total = 0
    for i, call in enumerate(calls):
        call_path = f"{path}[{i}]"
        if not isinstance(call, Mapping):
            raise PromptShapeError(f"{call_path} must be an object")
        function = call.get("function")
        if function is not None:
            total += _count_function_call(function, f"{call_path}.function", counter)
        else:  # custom tools carry their input elsewhere: count the whole call
            total += counter.count(json_text(call))
    return total


_MESSAGE_HANDLED = frozenset(
    {"role", "content", "name", "tool_calls", "function_call", "tool_call_id"}
)


def _count_message(message: Any, path: str, counter: TokenCounter, spec: TokenizerSpec) -> int:
    if not isinstance(message, Mapping):
        raise PromptShapeError(f"{path} must be an object")
    total = spec.tokens_per_message
    role = message.get("role")
    if role is not None:
        total += counter.count(require_text(role, f"{path}.role"))
    total += _count_content(message.get("content"), f"{path}.content", counter, spec)
    name = message.get("name")
    if name is not None:
        total += counter.count(require_text(name, f"{path}.name")) + spec.tokens_per_name
    total += _count_tool_calls(message.get("tool_calls"), f"{path}.tool_calls", counter)
    function_call = message.get("function_call")
    if function_call is not None:
        total += _count_function_call(function_call, f"{path}.function_call", counter)
    tool_call_id = message.get("tool_call_id")
    if tool_call_id is not None:
        total += counter.count(require_text(tool_call_id, f"{path}.tool_call_id"))
    for key, value in message.items():
        # Anything else the model may see (refusal, reasoning text, ...): strings as
        # text, structured values as JSON. Over-counting is the safe direction.
        if key in _MESSAGE_HANDLED or value is None:
            continue
        total += counter.count(value if isinstance(value, str) else json_text(value))
    return total


def _count_definitions(value: Any, field: str, counter: TokenCounter) -> int:
    if value is None:
        return 0
    if not isinstance(value, list):
        raise PromptShapeError(f"{field} must be a list")
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise PromptShapeError(f"{field}[{i}] must be an object")
    return counter.count(json_text(value)) if value else 0


def count_chat_request(body: Mapping[str, Any], counter: TokenCounter, spec: TokenizerSpec) -> int:
    """Input tokens of a ``/v1/chat/completions`` body.

    Per message: ``tokens_per_message`` + role + content + name (+ ``tokens_per_name``)
    + tool call names and arguments + ``tool_call_id``. Content parts: text counted,
    images ``image_tokens``, audio ``audio_tokens``, files ``file_tokens``, unknown parts
    by their JSON text. Then ``tools``/``functions`` definitions and a
    ``response_format`` JSON schema by their compact JSON, and ``reply_priming_tokens``
    once. Raises :class:`PromptShapeError` naming the offending field.
    """
    if not isinstance(body, Mapping):
        raise PromptShapeError("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise PromptShapeError("messages must be a list")
    total = spec.reply_priming_tokens
    for i, message in enumerate(messages):
        total += _count_message(message, f"messages[{i}]", counter, spec)
    total += _count_definitions(body.get("tools"), "tools", counter)
    total += _count_definitions(body.get("functions"), "functions", counter)
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise PromptShapeError("response_format must be an object")
        schema = response_format.get("json_schema")
        if schema is not None:
            if not isinstance(schema, Mapping):
                raise PromptShapeError("response_format.json_schema must be an object")
            total += counter.count(json_text(schema))
    return total


def _is_token_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _count_prompt_item(item: Any, path: str, counter: TokenCounter) -> int:
    if isinstance(item, str):
        return counter.count(item)
    if isinstance(item, list) and _is_token_ids(item):
        return len(item)
    raise PromptShapeError(f"{path} must be a string or a list of token ids")


def count_completion_prompt(body: Mapping[str, Any], counter: TokenCounter) -> int:
    """Input tokens of a ``/v1/completions`` body.

    ``prompt`` may be a string, a list of strings (summed), a list of token ids (its
    length) or a list of token-id lists (summed lengths); a missing prompt counts 0.
    ``suffix`` text, when present, is counted too. Raises :class:`PromptShapeError`.
    """
    if not isinstance(body, Mapping):
        raise PromptShapeError("request body must be a JSON object")
    prompt = body.get("prompt")
    total = 0
    if prompt is None:
        pass
    elif isinstance(prompt, str):
        total = counter.count(prompt)
    elif isinstance(prompt, list):
        if prompt and _is_token_ids(prompt):
            total = len(prompt)
        else:
            total = sum(
                _count_prompt_item(item, f"prompt[{i}]", counter) for i, item in enumerate(prompt)
            )
    else:
        raise PromptShapeError(
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of token-id lists"
        )
    suffix = body.get("suffix")
    if suffix is not None:
        total += counter.count(require_text(suffix, "suffix"))
    return total
