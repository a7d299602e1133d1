"""What a caller of the RLS API sends, as the decision logic reads it: its descriptors
(:class:`Descriptor`) and the caps that bound them before anything is looked up
(:class:`Caps`; a request past one is refused with :class:`RequestError` naming it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class RequestError(ValueError):
    """A request the service refuses to evaluate (answered ``INVALID_ARGUMENT``)."""


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One ``RateLimitDescriptor``: its entries, its own ``hits_addend`` (None: unset) and a
    limit override from Envoy's route config (``(unit, requests_per_unit)``)."""

    entries: tuple[tuple[str, str], ...]
    hits_addend: int | None = None
    override: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Caps:
    """What one request may carry (a caller's descriptors become Redis keys and work): each
    exceeded cap is refused with :class:`RequestError` naming it (``AIQ_RLS_MAX_*``)."""

    descriptors: int = 32  # descriptors per request
    entries: int = 16  # entries per descriptor
    key_length: int = 128  # characters of an entry's key (and of the domain)
    value_length: int = 512  # characters of an entry's value
    hits_addend: int = 1_000_000  # a request's or a descriptor's hits_addend

    def check(self, domain: str, descriptors: Sequence[Descriptor], hits_addend: int) -> None:
        """:class:`RequestError` naming the first cap the request exceeds."""
        if len(domain) > self.key_length:
            raise RequestError(
                f"the domain is {len(domain)} characters, more than the cap "
                f"AIQ_RLS_MAX_KEY_LENGTH={self.key_length}"
            )
        if len(descriptors) > self.descriptors:
            raise RequestError(
                f"{len(descriptors)} descriptors in one request, more than the cap "
                f"AIQ_RLS_MAX_DESCRIPTORS={self.descriptors}"
            )
        if hits_addend > self.hits_addend:
            raise RequestError(
                f"hits_addend {hits_addend} is more than the cap "
                f"AIQ_RLS_MAX_HITS_ADDEND={self.hits_addend}"
            )
        for i, d in enumerate(descriptors):
            if len(d.entries) > self.entries:
                raise RequestError(
                    f"descriptor {i} has {len(d.entries)} entries, more than the cap "
                    f"AIQ_RLS_MAX_ENTRIES={self.entries}"
                )
            if d.hits_addend is not None and d.hits_addend > self.hits_addend:
                raise RequestError(
                    f"descriptor {i}'s hits_addend {d.hits_addend} is more than the cap "
                    f"AIQ_RLS_MAX_HITS_ADDEND={self.hits_addend}"
                )
            for k, v in d.entries:
                if len(k) > self.key_length:
                    raise RequestError(
                        f"descriptor {i} has a key of {len(k)} characters, more than the cap "
                        f"AIQ_RLS_MAX_KEY_LENGTH={self.key_length}"
                    )
                if len(v) > self.value_length:
                    raise RequestError(
                        f"descriptor {i} has a value of {len(v)} characters, more than the cap "
                        f"AIQ_RLS_MAX_VALUE_LENGTH={self.value_length}"
                    )


#: The caps when none are given.
DEFAULT_CAPS = Caps()
