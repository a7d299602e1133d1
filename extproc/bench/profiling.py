"""Parsing py-spy's ``--format raw`` output into own-time and inclusive samples per function
and own-time samples per module (used by the ``profile`` scenario)."""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path


def pyspy_path() -> str | None:
    """The py-spy executable (beside this Python first), or None."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def parse_pyspy_raw(text: str) -> tuple[Counter[str], Counter[str], Counter[str], int]:
    """Own-time samples per function, inclusive samples per function and own-time samples per
    module (Python file or native library) from py-spy's ``--format raw`` output."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    mods: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        n = int(count_s)
        total += n
        frames = [_frame_name(f) for f in stack.split(";")]
        own[frames[-1]] += n
        mods[_module(frames[-1])] += n
        for f in set(frames):
            incl[f] += n
    return own, incl, mods, total


def _module(frame: str) -> str:
    """``func (file.py)`` → ``file.py``; native frames keep their library name."""
    _, _, where = frame.rpartition(" (")
    return where.rstrip(")") or frame


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` → ``func (dir/file.py)``."""
    func, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path = where.rsplit(":", 1)[0] if where.endswith(tuple("0123456789")) else where
    parts = path.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{func} ({short})"
