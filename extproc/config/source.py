"""Parsing a rules file's YAML with positions: every error says ``file:line:col``.

:class:`RulesLoader` is a :class:`yaml.SafeLoader` that refuses a mapping with the same key twice
(plain PyYAML keeps the last one silently) and remembers where each node of the document starts,
by the same path the validation errors use (``tenants.acme.keys[0].sha256``), so an error found
after parsing can still point at its line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

_MERGE_TAG = "tag:yaml.org,2002:merge"


def render_path(parts: tuple[str | int, ...] | list[str | int]) -> str:
    """``("tenants", "acme", "keys", 0, "sha256")`` -> ``tenants.acme.keys[0].sha256``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


class DuplicateKeyError(ConstructorError):
    """A mapping holds the same key twice; ``problem_mark`` is the second occurrence."""


class RulesLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate keys and records where every node starts."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        #: rendered path -> the mark where its node starts (for a mapping value: its key)
        self.node_marks: dict[str, yaml.Mark] = {}

    def compose_document(self) -> Node | None:
        """Compose as usual, then check the node tree before anything is constructed."""
        node: Node | None = super().compose_document()
        if node is not None:
            self._walk(node, [], set())
        return node

    def _walk(self, node: Node, path: list[str | int], seen: set[int]) -> None:
        if id(node) in seen:  # an alias of a node already walked (or a recursive one)
            return
        seen.add(id(node))
        if isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                here = [*path, i]
                self._mark(here, item.start_mark)
                self._walk(item, here, seen)
        elif isinstance(node, MappingNode):
            first: dict[tuple[str, str], yaml.Mark] = {}
            for key, value in node.value:
                if key.tag == _MERGE_TAG or not isinstance(key, ScalarNode):
                    continue  # merged keys may be overridden; complex keys are left to PyYAML
                ident = (key.tag, key.value)
                if ident in first:
                    where = render_path(path) or "(top level)"
                    raise DuplicateKeyError(
                        None,
                        None,
                        f"{where}: duplicate key {key.value!r} "
                        f"(first at line {first[ident].line + 1})",
                        key.start_mark,
                    )
                first[ident] = key.start_mark
                here = [*path, key.value]
                self._mark(here, key.start_mark)
                self._walk(value, here, seen)

    def _mark(self, path: list[str | int], mark: yaml.Mark) -> None:
        self.node_marks.setdefault(render_path(path), mark)


@dataclass
class Parsed:
    """A parsed rules document and where its nodes start."""

    data: Any
    marks: dict[str, yaml.Mark] = field(default_factory=dict)

    def position(self, parts: tuple[str | int, ...] | list[str | int]) -> yaml.Mark | None:
        """Where ``parts`` starts, else where its nearest existing ancestor does (a missing
        field points at the mapping it is missing from); None for the top level."""
        for n in range(len(parts), 0, -1):
            mark = self.marks.get(render_path(parts[:n]))
            if mark is not None:
                return mark
        return None


class YamlSyntaxError(ValueError):
    """The text is not YAML (or repeats a key); ``str()`` is ``source:line:col: ...``."""


def where(source: str, mark: yaml.Mark | None) -> str:
    """``rules.yaml:12:3`` (1-based, like an editor), or just the source without a mark."""
    return source if mark is None else f"{source}:{mark.line + 1}:{mark.column + 1}"


def parse_rules(text: str, source: str) -> Parsed:
    """Parse one YAML document with :class:`RulesLoader`.

    Raises :class:`YamlSyntaxError` naming ``source`` and the line and column of the problem."""
    loader = RulesLoader(text)
    try:
        data = loader.get_single_data()
    except DuplicateKeyError as exc:
        raise YamlSyntaxError(f"{where(source, exc.problem_mark)}: {exc.problem}") from exc
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "invalid YAML"
        if exc.context and exc.problem:
            at = exc.context_mark
            other = at is not None and (mark is None or at.line != mark.line)
            what += f" ({exc.context}" + (f" at line {at.line + 1})" if at and other else ")")
        raise YamlSyntaxError(f"{where(source, mark)}: not valid YAML: {what}") from exc
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(f"{source}: not valid YAML: {exc}") from exc
    finally:
        loader.dispose()
    return Parsed(data, loader.node_marks)


# ``<source>: <path>: message`` as written by the checks that run after validation.
_PATH_PREFIX = re.compile(r"^(?P<path>[^\s:]+?): ")
_LAST_PART = re.compile(r"(\.[^.\[\]]+|\[\d+\])$")


def locate(message: str, source: str, parsed: Parsed) -> str:
    """Turn each ``<source>: <path>: ...`` line of ``message`` into ``<source>:<line>:<col>:
    <path>: ...`` when the path (or its nearest ancestor) is found in the document."""
    out = []
    head = f"{source}: "
    for line in message.split("\n"):
        path, rest = "", ""
        if line.startswith(head):
            rest = line[len(head) :]
            m = _PATH_PREFIX.match(rest)
            path = m.group("path") if m else ""
            while path and path not in parsed.marks:
                path = _LAST_PART.sub("", path) if _LAST_PART.search(path) else ""
        out.append(f"{where(source, parsed.marks[path])}: {rest}" if path else line)
    return "\n".join(out)
