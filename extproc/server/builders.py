"""How a request's sub-machines are built (:class:`extproc.core.sub_machines.Builders`): with
the rules the request started with and the gateway's key prefix, counters' hints and clock.
The session starts them when the request gets there and feeds them its events."""

from __future__ import annotations

from extproc.config.runtime import RuntimeConfig
from extproc.core.admission_flow import Admission
from extproc.core.encoding import BodyDecoder
from extproc.core.policies import fails_open
from extproc.core.session import Session
from extproc.core.streaming import MeteredStream
from extproc.gateway import Gateway


class RequestMachines:
    """Builds one request's admission and metered stream."""

    __slots__ = ("cfg", "gw")

    def __init__(self, gw: Gateway, cfg: RuntimeConfig) -> None:
        self.gw = gw
        self.cfg = cfg

    def admission(self, s: Session) -> Admission:
        """The request's admission, on the rules it started with."""
        gw = self.gw
        return Admission(
            s,
            self.cfg,
            key_prefix=gw.key_prefix,
            room=gw.room,
            records=gw.recorder is not None,
            now_ms=gw.clock.now_ms,
        )

    def stream(self, s: Session, decoder: BodyDecoder | None) -> MeteredStream:
        """The response's metered stream (``decoder``: the upstream's content encoding)."""
        cfg = self.cfg
        return MeteredStream(
            s,
            decoder,
            force_include_usage=cfg.force_include_usage,
            key_prefix=self.gw.key_prefix,
            lease_ms=cfg.reservation_lease_ms,
            fail_open=fails_open(cfg.failure_mode_for(s.plan)),
            now_ms=self.gw.clock.now_ms,
        )
