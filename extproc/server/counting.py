"""Counting a request's input tokens: small bodies inline, large ones in worker threads (tiktoken
releases the GIL), at most ``Gateway.count_slots`` at a time and within the counting deadline,
so a burst of huge prompts queues instead of slowing every other tenant's chunks.

The cheap alternative admission may decide on, the same walk of the request with the model's
upper-bound counter (no tokenizer run), is the core's
:func:`extproc.core.admission_flow.bound_input`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from extproc.config.runtime import RuntimeConfig
from extproc.core.admission_flow import client_errors
from extproc.core.apis.base import ApiFormat, ParsedRequest
from extproc.core.phase_records import AdmitModel
from extproc.errors import GatewayBusy
from extproc.gateway import Gateway

# Bodies longer than this (bytes) are counted in a worker thread.
OFFLOAD_BYTES = 16_384


async def count_input(
    gw: Gateway,
    cfg: RuntimeConfig,
    api: ApiFormat,
    req: ParsedRequest,
    model: AdmitModel,
    *,
    size: int,
) -> int:
    """The request's input tokens by ``model``'s tokenizer (raises the client-facing errors)."""

    def count() -> int:
        return api.count_input(req, model.counter, model.tokenizer)

    t0 = time.perf_counter()
    with client_errors:
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
