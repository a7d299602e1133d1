"""Counting a request's input tokens: small bodies inline, large ones in worker threads (tiktoken
releases the GIL), at most ``Gateway.count_slots`` at a time and within the counting deadline,
so a burst of huge prompts queues instead of slowing every other tenant's chunks.

:func:`bound_input` is the cheap alternative admission may decide on: the same walk of the
request with the model's upper-bound counter (no tokenizer run)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import TracebackType

from extproc.config.runtime import Model, RuntimeConfig
from extproc.core.apis.base import ApiFormat, ParsedRequest
from extproc.core.tokens import PromptShapeError, PromptTooLarge
from extproc.errors import BadRequest, GatewayBusy, RequestTooLarge
from extproc.gateway import Gateway

# Bodies longer than this (bytes) are counted in a worker thread.
OFFLOAD_BYTES = 16_384


class _ClientErrors:
    """What a body's walk raises, as the client's error (a class, not ``@contextmanager``:
    entered once or twice per request, a generator each time costs more than the walk of a
    short prompt)."""

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


_client_errors = _ClientErrors()


async def count_input(
    gw: Gateway, cfg: RuntimeConfig, api: ApiFormat, req: ParsedRequest, model: Model, *, size: int
) -> int:
    """The request's input tokens by ``model``'s tokenizer (raises the client-facing errors)."""

    def count() -> int:
        return api.count_input(req, model.counter, model.tokenizer)

    t0 = time.perf_counter()
    with _client_errors:
        n = await _run(gw, cfg, count, size)
    gw.metrics.tokenize_seconds.labels(api.name).observe(time.perf_counter() - t0)
    return n


async def _run(gw: Gateway, cfg: RuntimeConfig, count: Callable[[], int], size: int) -> int:
    if size <= OFFLOAD_BYTES:
        return count()
    try:
        async with asyncio.timeout(cfg.count_deadline_ms / 1000), gw.count_slots:
            return await asyncio.to_thread(count)
    except TimeoutError:
        raise GatewayBusy(
            "The gateway is busy counting other large prompts; retry in a second."
        ) from None


def bound_input(api: ApiFormat, req: ParsedRequest, model: Model) -> int | None:
    """An upper bound on :func:`count_input`'s answer without running the tokenizer (the same
    walk, so the same client errors), or None where the model's tokenizer has no proven bound."""
    bound = model.bound_counter
    if bound is None:
        return None
    with _client_errors:
        return api.count_input(req, bound, model.tokenizer)
