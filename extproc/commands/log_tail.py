"""What ``ai-quota up`` shows of the processor's JSON log: new lines read as the file grows,
and one terminal line per admission decision, stream cut, settlement, warning or error."""

from __future__ import annotations

from pathlib import Path

import orjson

_DECISION_FIELDS = (
    "tenant",
    "key",
    "model",
    "input_tokens",
    "reserved_output",
    "stream",
    "status",
    "code",
)


def format_log_line(line: str) -> str | None:
    """One terminal line for an ext_proc JSON log line worth showing in ``ai-quota up``: every
    admission decision, stream cut and settlement, and any warning or error; None otherwise."""
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        return line.rstrip() or None
    if not isinstance(rec, dict):
        return None
    event, level = rec.get("event"), rec.get("level", "info")
    stamp = str(rec.get("timestamp", ""))[11:19]
    if event == "decision":
        fields = " ".join(f"{k}={rec[k]}" for k in _DECISION_FIELDS if rec.get(k) is not None)
        return f"{stamp} {rec.get('decision', '?'):<9} {fields}"
    if event in ("stream_cut", "settled"):
        skip = {"event", "level", "timestamp", "logger"}
        return f"{stamp} {event:<9} " + " ".join(
            f"{k}={v}" for k, v in rec.items() if k not in skip
        )
    if level in ("warning", "error", "critical"):
        skip = {"event", "level", "timestamp", "logger"}
        rest = " ".join(f"{k}={v}" for k, v in rec.items() if k not in skip)
        return f"{stamp} {level.upper()} {event} {rest}".rstrip()
    return None


class LogFollower:
    """Reads what was appended to a log file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self._partial = ""

    def new_lines(self) -> list[str]:
        """The whole lines appended since the last call (a partial last line waits)."""
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        text = self._partial + data.decode(errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        return lines
