"""Loading an RLS config from disk: the YAML files a path stands for, each parsed
(:func:`extproc.rls.parse.parse_text`), compiled into one :class:`~extproc.rls.config.RlsConfig`
or an :class:`~extproc.rls.config.RlsConfigError` with every file's errors (nothing is
half-applied); what changes when a file is written (:func:`signature`, for reloads), and whether
a path is an RLS config at all (:func:`looks_like_rls`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml

from extproc.rls.config import Domain, RlsConfig, RlsConfigError
from extproc.rls.parse import parse_text


def config_files(path: Path) -> list[Path]:
    """The YAML files a path stands for: the file itself, or a directory's ``*.yaml`` and
    ``*.yml`` (dot files, editors' temporaries, are left out), sorted by name."""
    if path.is_dir():
        return sorted(
            p
            for p in path.iterdir()
            if p.suffix in (".yaml", ".yml") and not p.name.startswith(".") and p.is_file()
        )
    return [path]


def compile_domains(domains: Iterable[Domain]) -> RlsConfig:
    """One config from parsed files; a domain defined twice is an error naming both files."""
    out: dict[str, Domain] = {}
    errors = []
    for d in domains:
        if d.name in out:
            errors.append(
                f"{d.source}:1: domain: duplicate domain '{d.name}' (also in {out[d.name].source})"
            )
            continue
        out[d.name] = d
    if errors:
        raise RlsConfigError(errors)
    return RlsConfig(out, tuple(d.source for d in out.values()))


def load_path(path: str | Path) -> RlsConfig:
    """Load a file or a directory of files; every file's errors together, or the config."""
    p = Path(path)
    if not p.exists():
        raise RlsConfigError([f"{p}: no such file or directory"])
    files = config_files(p)
    if not files:
        raise RlsConfigError([f"{p}: no *.yaml or *.yml file in the directory"])
    domains, errors = [], []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            errors.append(f"{file}: cannot read: {exc}")
            continue
        try:
            domains.append(parse_text(text, str(file)))
        except RlsConfigError as exc:
            errors.extend(exc.errors)
    if errors:
        raise RlsConfigError(errors)
    return compile_domains(domains)


def signature(path: str | Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when a config file is written: names, sizes, modification times."""
    p = Path(path)
    out = []
    try:
        for file in config_files(p):
            st = file.stat()
            out.append((str(file), st.st_size, st.st_mtime_ns))
    except OSError:
        return ()
    return tuple(out)


def looks_like_rls(path: str | Path) -> bool:
    """Whether a path is an RLS config (a directory, or a YAML mapping with a ``domain``)."""
    p = Path(path)
    if p.is_dir():
        return True
    try:
        doc = yaml.compose(p.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(doc, yaml.MappingNode) and any(
        isinstance(k, yaml.ScalarNode) and k.value == "domain" for k, _ in doc.value
    )
