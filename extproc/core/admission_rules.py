"""What admission reads of the configuration (:class:`AdmissionRules`, structural: the core
imports no config), and the walk of a request body with a tokenizer as the client's errors
(:data:`client_errors`, :func:`bound_input`).  Sans-IO."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Final, Literal, Protocol

from extproc.core.apis.base import ApiFormat, ParsedRequest
from extproc.core.phase_records import AdmitModel
from extproc.core.rules import Charging
from extproc.core.tokens import PromptShapeError, PromptTooLarge
from extproc.core.waiting import WaitRule
from extproc.errors import BadRequest, RequestTooLarge


class AdmissionRules(Protocol):
    """What admission reads of the configuration (structural: the core imports no config)."""

    @property
    def max_body_bytes(self) -> int: ...
    @property
    def max_tokens_ceiling(self) -> int: ...
    @property
    def max_n(self) -> int: ...
    @property
    def unknown_model_action(self) -> str: ...
    @property
    def unknown_model_status(self) -> int: ...
    @property
    def unknown_model(self) -> AdmitModel: ...
    @property
    def models(self) -> Mapping[str, AdmitModel]: ...
    @property
    def fallbacks(self) -> Mapping[str, Mapping[str, str]]: ...
    @property
    def over_model_cap(self) -> Literal["clamp", "reject"]: ...
    @property
    def count_refused_requests(self) -> bool: ...
    @property
    def force_include_usage(self) -> bool: ...
    @property
    def reservation_lease_ms(self) -> int: ...
    @property
    def ledger_ttl_seconds(self) -> int: ...
    @property
    def admit_on_bound(self) -> bool: ...
    @property
    def bound_headroom(self) -> float: ...
    @property
    def bound_below(self) -> float: ...
    def wait_for(self, plan: str, tenant: str, key: str) -> WaitRule | None: ...
    def resolve_model(self, name: str) -> AdmitModel | None: ...
    def failure_mode_for(self, plan: str) -> str: ...
    def charging_for(self, plan: str, model: str) -> Charging: ...


class _ClientErrors:
    """What a body's walk (a count, a bound) raises, as the client's error (a class, not
    ``@contextmanager``: entered once or twice per request, a generator each time costs more
    than the walk of a short prompt)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            return
        if isinstance(exc, PromptTooLarge):
            raise RequestTooLarge(str(exc)) from None
        if isinstance(exc, PromptShapeError):
            raise BadRequest(str(exc)) from None
        if isinstance(exc, RecursionError):
            raise BadRequest("the request body is nested too deeply") from None


#: ``with client_errors:`` maps the walk's errors to the client's.
client_errors: Final = _ClientErrors()


def bound_input(api: ApiFormat, req: ParsedRequest, model: AdmitModel) -> int | None:
    """An upper bound on the exact input count without running the tokenizer (the same walk,
    so the same client errors), or None where the model's tokenizer has no proven bound."""
    bound = model.bound_counter
    if bound is None:
        return None
    with client_errors:
        return api.count_input(req, bound, model.tokenizer)
