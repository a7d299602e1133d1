"""Hugging Face tokenizers from local files: a ``tokenizer.json`` loaded with the optional
``tokenizers`` library (:func:`load_huggingface_tokenizer`), and the chat template of the
``tokenizer_config.json`` (or ``chat_template.jinja``) beside it, compiled in a sandboxed Jinja
environment with the special tokens it is rendered with (:func:`load_chat_template`).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from extproc.core.chat_template import ChatTemplate, ContentFormat
from extproc.tokenizers.errors import TokenizerLoadError, where

__all__ = ["load_chat_template", "load_huggingface_tokenizer"]


def load_huggingface_tokenizer(path: str, model: str | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file.

    Raises :class:`TokenizerLoadError` when the file is missing or unreadable, or when the
    optional ``tokenizers`` library is not installed."""
    about = where(model, None, path)
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise TokenizerLoadError(
            f"Hugging Face tokenizers need the 'tokenizers' package ({about}): "
            "pip install 'ai-quota[huggingface]'"
        ) from exc
    file_path = os.path.expanduser(path)
    if not os.path.isfile(file_path):
        raise TokenizerLoadError(f"Hugging Face tokenizer.json not found ({about})")
    try:
        return Tokenizer.from_file(file_path)
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise TokenizerLoadError(f"cannot load Hugging Face tokenizer ({about}): {exc}") from exc


#: Special-token fields of ``tokenizer_config.json`` handed to the template as variables.
_SPECIAL_FIELDS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: Any) -> str | None:
    """A special token as saved by transformers: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path, about: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path.name} ({about}): {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path.name} must hold a JSON object ({about})")
    return data


def _template_source(config: dict[str, Any], directory: Path, about: str) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerLoadError(f"cannot read chat_template.jinja ({about}): {exc}") from exc
    source = config.get("chat_template")
    if source is None:
        return None
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
        if source is None:
            return None
    if not isinstance(source, str):
        raise TokenizerLoadError(f"tokenizer_config.json: chat_template must be a string ({about})")
    return source


def _content_format(ast: Any) -> ContentFormat:
    """``openai`` when the template loops over a message's content (``for part in
    message['content']`` inside a loop over ``messages``), else ``string``: the detection vLLM
    uses to decide whether a template gets content parts or one joined string."""
    from jinja2 import nodes

    message_names = {
        loop.target.name
        for loop in ast.find_all(nodes.For)
        if isinstance(loop.iter, nodes.Name)
        and loop.iter.name == "messages"
        and isinstance(loop.target, nodes.Name)
    }
    message_names.add("message")
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Filter) and it.node is not None:  # message['content'] | x
            it = it.node
        base: Any = None
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const):
            base, key = it.node, it.arg.value
        elif isinstance(it, nodes.Getattr):
            base, key = it.node, it.attr
        else:
            continue
        if key == "content" and isinstance(base, nodes.Name) and base.name in message_names:
            return "openai"
    return "string"


def load_chat_template(path: str, model: str | None = None) -> ChatTemplate | None:
    """The chat template of the Hugging Face tokenizer whose ``tokenizer.json`` is ``path``:
    ``chat_template.jinja`` or the ``chat_template`` of ``tokenizer_config.json`` in the same
    directory, compiled in Jinja's immutable sandbox with the variables and filters transformers
    gives templates (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII,
    ``loopcontrols``, a ``{% generation %}`` block that renders its body), and rendered with the
    special tokens of ``tokenizer_config.json`` / ``special_tokens_map.json``.

    None when the directory has no template.  Raises :class:`TokenizerLoadError` for a template
    that does not compile, an unreadable config, or a missing ``jinja2``."""
    about = where(model, None, path)
    directory = Path(os.path.expanduser(path)).parent
    config_file = directory / "tokenizer_config.json"
    config = _read_json(config_file, about) if config_file.is_file() else {}
    source = _template_source(config, directory, about)
    if source is None:
        return None
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise TokenizerLoadError(
            f"the chat template needs the 'jinja2' package ({about}): "
            "pip install 'ai-quota[huggingface]'"
        ) from exc

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text): its body."""

        tags = {"generation"}  # jinja2's own class attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        ast = env.parse(source)
        compiled = env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerLoadError(f"the chat template does not compile ({about}): {exc}") from exc
    specials_file = directory / "special_tokens_map.json"
    specials = _read_json(specials_file, about) if specials_file.is_file() else {}
    variables: dict[str, Any] = {}
    for name in _SPECIAL_FIELDS:
        text = _token_text(config.get(name))
        if text is None:
            text = _token_text(specials.get(name))
        if text is not None:
            variables[name] = text
    extra = config.get("additional_special_tokens", specials.get("additional_special_tokens"))
    if isinstance(extra, list):
        variables["additional_special_tokens"] = [
            t for t in (_token_text(v) for v in extra) if t is not None
        ]
    return ChatTemplate(compiled, _content_format(ast), variables, source=str(directory))
