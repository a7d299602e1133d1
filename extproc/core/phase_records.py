"""One request's phase records: typed, immutable, each set once by the session
(:class:`extproc.core.session.Session`), and what the session needs to know of the
configuration (structural protocols: the core imports no config).

A request moves through phases (the transition table of :mod:`extproc.core.lifecycle`); each
phase leaves one frozen record, so which fact is valid when is visible in the types:

==============  ======================================================================
record          holds
==============  ======================================================================
``Requested``   request id, path, the API its path names (before the caller is known)
``Identified``  request id, path, API, the caller (key, tenant), the ledger id
``Parsed``      the parsed body and the model it is counted as (the requested one)
``Admitted``    the model served, the cost (None: admitted unmetered), buckets, time,
                the headers to add to the response
``Responding``  the upstream's status and how the response is metered
``Reported``    what the upstream said it used (a JSON body's or a stream's ``usage``)
``Settlement``  the final figures: ending, total to charge, input, output, usage
==============  ======================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from extproc.core.admission_plan import Cost
from extproc.core.apis.base import ApiFormat, ParsedRequest
from extproc.core.chunks import Usage as UpstreamUsage
from extproc.core.keys import WindowedBucket
from extproc.core.rules import Limit, Rates
from extproc.core.tokens import TokenCounter, TokenizerSpec

# -- what the session needs to know of the configuration (structural: core imports no config) --


class ModelInfo(Protocol):
    """A metered model, as far as one request's decisions need it."""

    @property
    def name(self) -> str: ...
    @property
    def known(self) -> bool: ...
    @property
    def prices(self) -> Rates | None: ...
    @property
    def currency(self) -> str: ...
    @property
    def max_input_tokens(self) -> int | None: ...
    @property
    def max_output_tokens(self) -> int: ...
    @property
    def exact_count(self) -> bool: ...
    @property
    def continuous_usage(self) -> bool: ...
    @property
    def abandoned_tokens_per_second(self) -> int: ...
    @property
    def exact_non_streams(self) -> bool: ...
    @property
    def exact_stream_interval(self) -> int | None: ...
    def stream_counter(self) -> Callable[[str], int]: ...


class AdmitModel(ModelInfo, Protocol):
    """A model as admission needs it: its tokenizer, to count the input exactly or (when it
    has a proven one) to bound it cheaply."""

    @property
    def counter(self) -> TokenCounter: ...
    @property
    def bound_counter(self) -> TokenCounter | None: ...
    @property
    def tokenizer(self) -> TokenizerSpec: ...


class TenantInfo(Protocol):
    """A tenant with its resolved limits."""

    @property
    def id(self) -> str: ...
    @property
    def plan(self) -> str: ...
    @property
    def limits(self) -> tuple[Limit, ...]: ...
    @property
    def slot(self) -> str: ...
    def limits_for(self, key_name: str) -> tuple[Limit, ...]: ...
    def strict_for(self, key_name: str) -> bool: ...
    def team_of(self, key_name: str) -> str: ...
    @property
    def organisation(self) -> str: ...


class KeyInfo(Protocol):
    """An API key's name (safe to log)."""

    @property
    def name(self) -> str: ...


# -- the phase records -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Requested:
    """Request headers read, before the caller is known: the request's id, its path and the
    API its path names (errors, even the caller's identification errors, speak its shape)."""

    request_id: str
    path: str = ""
    api: ApiFormat | None = None


@dataclass(frozen=True, slots=True)
class Identified:
    """The caller identified: who calls, on which path and API (the metered API the rules
    route the path to), and the request's ledger."""

    request_id: str
    path: str = ""
    api: ApiFormat | None = None
    key: KeyInfo | None = None
    tenant: TenantInfo | None = None
    ledger: str = ""
    # the end user the headers or token name (extproc.core.end_users), and whether the body's
    # is asked first
    end_user: str = ""
    end_user_body: bool = True
    # the priority class the request header asks for (a waiting plan's; None: none asked)
    priority: str | None = None


@dataclass(frozen=True, slots=True)
class Parsed:
    """The request body parsed, and the model it asked for (or the unknown-model stand-in)."""

    req: ParsedRequest
    model: ModelInfo


@dataclass(frozen=True, slots=True)
class Admitted:
    """Admission said yes. ``cost`` is None when Redis was down and the plan let the request
    through unmetered (fail-open): nothing to charge, settle or meter."""

    model: ModelInfo
    cost: Cost | None
    buckets: tuple[WindowedBucket, ...] = ()
    at_ms: int = 0
    headers: tuple[tuple[str, str], ...] = ()
    # admitted on an upper bound of the input (``cost.input_tokens``); the exact count comes
    # later (:meth:`Session.input_counted`) and the session's cost takes it before any figure
    # is decided (this record keeps what admission charged)
    input_bound: bool = False
    # the fewest tokens the tokenizer can count for that bound (every token stands for at
    # most its vocabulary's longest token in bytes): an upstream figure the counted path would
    # refuse for any count from here to the bound is checked against the count
    input_floor: int = 0
    # how long the request waited for its turn (docs/semantics.md, "Waiting")
    waited_ms: int = 0


MeteringKind = Literal[
    "local_reply",
    "unmetered",
    "upstream_error",
    "unmeterable",
    "stream",
    "exact",
    "read_json",
    "done",
]


@dataclass(frozen=True, slots=True)
class Metering:
    """How a response is handled: ``kind``, the body's decoder, why it cannot be metered."""

    kind: MeteringKind
    decoder: Any = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Responding:
    """Response headers read: the upstream's status and how the body is metered."""

    status: int
    metering: Metering


@dataclass(frozen=True, slots=True)
class Reported:
    """What the upstream said it used (``output`` includes reasoning, ``input`` cached input)."""

    input: int | None
    output: int | None
    cached_input: int = 0
    reasoning: int = 0

    @classmethod
    def of(cls, usage: UpstreamUsage) -> Reported:
        """The record of a JSON body's or a stream's parsed ``usage``."""
        return cls(
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_input_tokens,
            usage.reasoning_tokens,
        )


class PhaseError(RuntimeError):
    """A phase record set twice, or read before its phase."""


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """What the stream meter knows when settlement (or the last response) needs a figure:
    tokens counted, delivered, whether the API's terminal event passed and whether the gateway
    cut the stream."""

    counted: int
    delivered: int
    complete: bool
    cut: bool
    text_events: int = 0
