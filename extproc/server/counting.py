"""Counting a request's input tokens: small bodies inline, large ones in worker threads (tiktoken
releases the GIL), at most ``Gateway.count_slots`` at a time and within the counting deadline,
so a burst of huge prompts queues instead of slowing every other tenant's chunks."""

from __future__ import annotations

import asyncio
import time

from extproc.config.runtime import Model, RuntimeConfig
from extproc.core.apis.base import ApiFormat, ParsedRequest
from extproc.core.tokens import PromptShapeError, PromptTooLarge
from extproc.errors import BadRequest, GatewayBusy, RequestTooLarge
from extproc.gateway import Gateway

# Bodies longer than this (bytes) are counted in a worker thread.
OFFLOAD_BYTES = 16_384


async def count_input(
    gw: Gateway, cfg: RuntimeConfig, api: ApiFormat, req: ParsedRequest, model: Model, *, size: int
) -> int:
    """The request's input tokens by ``model``'s tokenizer (raises the client-facing errors)."""

    def count() -> int:
        return api.count_input(req, model.counter, model.tokenizer)

    t0 = time.perf_counter()
    try:
        if size > OFFLOAD_BYTES:
            async with asyncio.timeout(cfg.count_deadline_ms / 1000), gw.count_slots:
                n = await asyncio.to_thread(count)
        else:
            n = count()
    except TimeoutError:
        raise GatewayBusy(
            "The gateway is busy counting other large prompts; retry in a second."
        ) from None
    except PromptTooLarge as exc:
        raise RequestTooLarge(str(exc)) from None
    except PromptShapeError as exc:
        raise BadRequest(str(exc)) from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    gw.metrics.tokenize_seconds.labels(api.name).observe(time.perf_counter() - t0)
    return n
