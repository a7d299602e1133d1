"""Configuration of a load run (`LoadConfig`) and parsing helpers for its CLI spellings."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

Endpoint = Literal["chat", "completions"]
Arrival = Literal["poisson", "uniform"]

DEFAULT_DURATION_S = 10.0


class LoadConfigError(ValueError):
    """The load configuration is invalid (bad value or non-loopback target)."""


def is_loopback_url(url: str) -> bool:
    """True when ``url`` is http(s) and its host is ``localhost`` or a loopback IP literal."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return False
    host = (parts.hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_max_tokens(text: str) -> tuple[int, int]:
    """Parse ``N`` or ``LO:HI`` into an inclusive range."""
    try:
        if ":" in text:
            lo_s, hi_s = text.split(":", 1)
            lo, hi = int(lo_s), int(hi_s)
        else:
            lo = hi = int(text)
    except ValueError as exc:
        raise LoadConfigError(f"--max-tokens must be N or LO:HI, got {text!r}") from exc
    if lo < 1 or hi < lo:
        raise LoadConfigError(f"--max-tokens range must satisfy 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_limit(text: str) -> tuple[str, int]:
    """Parse ``KEY=N`` (a tenant's tokens-per-minute limit)."""
    key, sep, value = text.rpartition("=")
    if not sep or not key:
        raise LoadConfigError(f"--limit-tpm must be KEY=N, got {text!r}")
    try:
        n = int(value)
    except ValueError as exc:
        raise LoadConfigError(f"--limit-tpm value must be an integer, got {text!r}") from exc
    if n < 0:
        raise LoadConfigError(f"--limit-tpm must not be negative, got {text!r}")
    return key, n


def parse_weights(text: str) -> tuple[float, ...]:
    """Parse comma-separated non-negative weights, e.g. ``3,1``."""
    try:
        weights = tuple(float(w) for w in text.split(",") if w.strip())
    except ValueError as exc:
        raise LoadConfigError(f"--key-weights must be numbers like 3,1, got {text!r}") from exc
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise LoadConfigError(f"--key-weights must be non-negative with a positive sum: {text!r}")
    return weights


@dataclass(frozen=True)
class LoadConfig:
    """Everything a load run needs. Build it directly or from the CLI; call ``validated()``.

    Closed loop when ``rate`` is ``None`` (``concurrency`` workers, each sending its next request
    when the previous one ends); open loop otherwise (``rate`` requests/s, Poisson or uniform
    arrivals, at most ``max_in_flight`` concurrent). The run stops after ``duration`` seconds or
    ``requests`` requests, whichever comes first (``duration`` defaults to 10 s when neither is
    set); each request is bounded by ``request_timeout``.
    """

    targets: tuple[str, ...] = ("http://127.0.0.1:10000/v1",)
    keys: tuple[str, ...] = ("sk-test",)
    key_weights: tuple[float, ...] | None = None
    models: tuple[str, ...] = ("sim-small",)
    endpoint: Endpoint = "chat"
    stream_ratio: float = 0.8
    max_tokens: tuple[int, int] = (128, 128)
    prompt_tokens: int = 64
    concurrency: int = 8
    rate: float | None = None
    arrival: Arrival = "poisson"
    max_in_flight: int = 256
    duration: float | None = None
    requests: int | None = None
    request_timeout: float = 60.0
    window_seconds: float = 60.0
    limits_tpm: tuple[tuple[str, int], ...] = ()
    sim_url: str | None = None
    include_usage: bool = True
    seed: int = 0
    run_id: str | None = None
    progress: bool = False
    extra_headers: tuple[tuple[str, str], ...] = field(default=())

    @property
    def open_loop(self) -> bool:
        """True when requests arrive at a fixed rate rather than from closed-loop workers."""
        return self.rate is not None

    @property
    def effective_duration(self) -> float | None:
        """The duration bound actually applied (default when no bound is given at all)."""
        if self.duration is None and self.requests is None:
            return DEFAULT_DURATION_S
        return self.duration

    @property
    def limits(self) -> dict[str, int]:
        """Tokens-per-minute limit per tenant (API key)."""
        return dict(self.limits_tpm)

    def validated(self) -> LoadConfig:
        """Return ``self`` after checking every field; raise ``LoadConfigError`` otherwise."""
        if not self.targets:
            raise LoadConfigError("at least one --target is required")
        for url in (*self.targets, *(() if self.sim_url is None else (self.sim_url,))):
            if not is_loopback_url(url):
                raise LoadConfigError(f"only loopback http(s) URLs may be targeted, got {url!r}")
        if not self.keys:
            raise LoadConfigError("at least one --key is required")
        if self.key_weights is not None and len(self.key_weights) != len(self.keys):
            raise LoadConfigError("--key-weights needs exactly one weight per --key")
        if not self.models:
            raise LoadConfigError("at least one --model is required")
        if self.endpoint not in ("chat", "completions"):
            raise LoadConfigError(f"--endpoint must be chat or completions, not {self.endpoint}")
        if not 0.0 <= self.stream_ratio <= 1.0:
            raise LoadConfigError("--stream-ratio must be within 0..1")
        lo, hi = self.max_tokens
        if lo < 1 or hi < lo:
            raise LoadConfigError("max_tokens must satisfy 1 <= lo <= hi")
        if self.prompt_tokens < 1:
            raise LoadConfigError("--prompt-tokens must be at least 1")
        if self.concurrency < 1:
            raise LoadConfigError("--concurrency must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise LoadConfigError("--rate must be positive")
        if self.arrival not in ("poisson", "uniform"):
            raise LoadConfigError("--arrival must be poisson or uniform")
        if self.max_in_flight < 1:
            raise LoadConfigError("--max-in-flight must be at least 1")
        if self.duration is not None and self.duration <= 0:
            raise LoadConfigError("--duration must be positive")
        if self.requests is not None and self.requests < 1:
            raise LoadConfigError("--requests must be at least 1")
        if self.request_timeout <= 0:
            raise LoadConfigError("--request-timeout must be positive")
        if self.window_seconds <= 0:
            raise LoadConfigError("--window-seconds must be positive")
        unknown = sorted({k for k, _ in self.limits_tpm} - set(self.keys))
        if unknown:
            raise LoadConfigError(f"--limit-tpm names keys not passed with --key: {unknown}")
        return self
