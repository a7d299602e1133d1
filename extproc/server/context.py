"""One request as the server's executors see it: the process's shared parts (the
:class:`~extproc.gateway.Gateway`), the rules the request started with (a reload does not move
them) and its :class:`~extproc.core.session.Session`.  Made once per request by its
:class:`~extproc.server.processor.RequestProcessor` and handed to the modules that execute the
session's actions, in place of the three threaded one by one."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.config.runtime import RuntimeConfig
from extproc.core.session import Session
from extproc.gateway import Gateway


@dataclass(slots=True)
class RequestContext:
    """What executing one request's actions reads: ``gw``, ``cfg``, ``s``."""

    gw: Gateway  # shared by the process's requests (limiter, metrics, the background part)
    cfg: RuntimeConfig  # the rules this request started with
    s: Session  # the request's sans-IO session
