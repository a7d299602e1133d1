"""The simulator's approximation of a request's prompt tokens (cl100k tokens of the text, plus a
fixed framing per message and per conversation), for chat, completions, Responses and Messages
inputs.
"""

from __future__ import annotations

from typing import Any

from extproc.sim.text import count_tokens

#: per-message and per-conversation overhead used for the chat prompt-token approximation
TOKENS_PER_MESSAGE = 3
TOKENS_PER_REPLY = 3


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text")
        ]
        return "".join(parts)
    return ""


def chat_prompt_tokens(messages: list[Any]) -> int:
    """Approximate prompt tokens: cl100k tokens of text contents (+ names), +3/message, +3."""
    total = TOKENS_PER_REPLY
    for message in messages:
        total += TOKENS_PER_MESSAGE
        if isinstance(message, dict):
            total += count_tokens(_content_text(message.get("content")))
            name = message.get("name")
            if isinstance(name, str):
                total += count_tokens(name)
    return total


def completion_prompt_tokens(prompt: Any) -> int:
    """Prompt tokens of a completions prompt: a string, list of strings or token-id arrays."""
    if isinstance(prompt, str):
        return count_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return len(prompt)
        return sum(completion_prompt_tokens(p) for p in prompt)
    return 0


def responses_prompt_tokens(instructions: Any, items: Any) -> int:
    """Input tokens of a Responses request, approximated like chat messages.

    ``instructions`` counts as a system message; ``input`` is a string (one user message) or a
    list of items: messages (string or ``input_text`` parts), ``function_call_output`` items
    (their ``output``) and ``function_call`` items (their ``arguments``).
    """
    messages: list[Any] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "function_call_output":
                messages.append({"role": "tool", "content": item.get("output")})
            elif item.get("type") == "function_call":
                messages.append({"role": "assistant", "content": item.get("arguments")})
            else:
                messages.append(item)
    return chat_prompt_tokens(messages)


def messages_prompt_tokens(system: Any, messages: list[Any]) -> int:
    """Input tokens of an Anthropic Messages request, approximated like chat messages.

    ``system`` (a string or text blocks) counts as one message; content blocks of type ``text``
    count, ``tool_result`` blocks count their text content, other blocks (images, tool_use) not.
    """
    converted: list[Any] = []
    if system is not None:
        converted.append({"role": "system", "content": system})
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            parts: list[Any] = []
            for block in content:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    inner = block.get("content")
                    parts.append({"type": "text", "text": _content_text(inner)})
                else:
                    parts.append(block)
            content = parts
        converted.append({"role": message.get("role"), "content": content})
    return chat_prompt_tokens(converted)
