"""What the request path's scripts read: the KEYS and ARGV each one expects (the ``.lua`` file's
header says the same from the script's side), packed here by pure functions, and their
answers read back.  Nothing here talks to Redis.

A call's *replay form* (what the failover journal keeps, :mod:`extproc.limiter.journal`) is
laid out by the packer that laid out the call itself, so an offset into the arguments is
never computed elsewhere.  The allowance scripts' packers sit with the allowance code
(:mod:`extproc.limiter.allowance.store`), the RLS script's with its counter
(:mod:`extproc.limiter.rls_counter`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.core.keys import open_key
from extproc.core.rules import BucketCharge
from extproc.core.waiting import KIND_CODES
from extproc.limiter.base import (
    AdmitCall,
    AdmitResult,
    ChargeCall,
    ChargeResult,
    InputNote,
    Reclaimed,
    SettleCall,
)

#: How long a call's id is kept (ms): a retry or a journal replay within it counts nothing.
CALL_ID_TTL_MS = 60_000

#: admit.lua's bucket kinds.
_KIND = {"rpm": "r", "tpm": "t", "concurrency": "c", "users": "u"}
#: admit.lua: values per bucket, and where its shadow flag sits among them.
ADMIT_BUCKET_ARGS = 8
ADMIT_SHADOW_AT = 5
#: charge.lua: where the strict flag sits in a charge's ARGV slice (after ``m``), and where
#: the count of previous-window keys sits.
CHARGE_STRICT_AT = 2
CHARGE_PREV_AT = 5


@dataclass(slots=True)
class Packed:
    """One script call's KEYS and ARGV."""

    keys: list[str] = field(default_factory=list)
    args: list[Any] = field(default_factory=list)


def call_id_key(key: str, call_id: str) -> str:
    """A key for ``call_id`` in the Cluster slot of ``key``: ``{<key's hash tag>}:aiq:call:<id>``
    (the whole key stands for the tag when it has none)."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return f"{{{key[start + 1 : end]}}}:aiq:call:{call_id}"
    if "}" in key:  # no valid tag, and the key cannot be one: hash the key itself after it
        raise ValueError(f"cannot place a call id in the slot of {key!r}")
    return f"{{{key}}}:aiq:call:{call_id}"


def text(value: Any) -> str:
    """A script's string answer (bytes from the wire)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _previous(keys: list[str], b: BucketCharge) -> list[int]:
    """A sliding bucket's previous-window counter, appended to ``keys``: [its 1-based KEYS
    index, weight]; [0, 0] for a fixed window."""
    if not b.prev_key:
        return [0, 0]
    keys.append(b.prev_key)
    return [len(keys), b.prev_weight]


# -- settle.lua (settle_lib.lua: also the riders of admit.lua) --------------------------------


def add_settlement(p: Packed, s: SettleCall) -> None:
    """Append one request's KEYS and ARGV slices (settle_lib.lua's ``settle_all``)."""
    keys, args = p.keys, p.args
    u = s.unconfirmed
    unconfirmed = u.rates if u else ()
    keys.append(s.ledger)
    keys.append(open_key(s.ledger))
    args += (
        s.ledger_ttl_ms,
        "1" if s.cancel else "0",
        u.seq if u else 0,
        len(s.adjustments),
        len(unconfirmed),
    )
    for a in s.adjustments:
        keys.append(a.key)
        args.append(a.amount)
        args.append(a.expire_at_ms)
    for key, rate in unconfirmed:
        keys.append(key)
        args.append(rate)


def settlements(items: Sequence[SettleCall]) -> Packed:
    """A ``settle.lua`` call settling ``items`` in order (its replay form is itself)."""
    p = Packed([], [len(items)])
    for s in items:
        add_settlement(p, s)
    return p


# -- admit.lua ---------------------------------------------------------------------------------


@dataclass(slots=True)
class PackedAdmission(Packed):
    """An ``admit.lua`` call, with where its buckets' arguments start."""

    first_bucket: int = 0
    buckets: int = 0
    queue_at: int = 0  # where the queue section starts (its length is the last argument)

    def replay(self) -> list[Any]:
        """The arguments it is journalled with: every bucket shadow (counted, never refused
        by a new master), without the queue (a replay admits: no ticket is taken)."""
        out = [*self.args[: self.queue_at], 0]
        for i in range(self.buckets):
            out[self.first_bucket + ADMIT_BUCKET_ARGS * i + ADMIT_SHADOW_AT] = 1
        return out


def admission(call: AdmitCall) -> PackedAdmission:
    """An ``admit.lua`` call: the riding settlements, then the request and its buckets."""
    ledger, buckets, riders = call.ledger, call.buckets, call.settlements
    p = PackedAdmission([], [len(riders)], 0, len(buckets))
    for s in riders:
        add_settlement(p, s)
    keys, args = p.keys, p.args
    args += (call.ledger_ttl_ms, "1" if call.count_refused else "0", call.tpm_charged)
    keys.append(ledger)
    keys += [b.key for b in buckets]
    keys.append(open_key(ledger))
    p.first_bucket = len(args)
    for b in buckets:
        args += (_KIND[b.kind], b.amount, b.limit, b.expire_at_ms, b.refundable, int(b.shadow))
        if b.prev_key:
            keys.append(b.prev_key)
            args += (len(keys), b.prev_weight)
        else:
            args += (0, 0)
    args += (call.now_ms, call.lease_until_ms, call.record_draft)
    p.queue_at = len(args)
    q = call.queue
    if q is None:
        args.append(0)
        return p
    keys.extend(q.keys)
    args += (len(keys) - 2, q.offset_ms, q.deadline_ms, q.lease_ms, q.cap, q.poll_ms)
    for kind, end, length in q.buckets:
        args += (KIND_CODES[kind], end, length)
    args.append(len(args) - p.queue_at)
    return p


def reclaimed(flat: Sequence[Any]) -> tuple[Reclaimed, ...]:
    """A reclaim's drafts, as the scripts hand them back: (ledger, draft, charged, input)..."""
    return tuple(
        Reclaimed(text(flat[i]), text(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]))
        for i in range(0, len(flat) - 3, 4)
    )


def admit_result(res: Any) -> AdmitResult:
    """``admit.lua``'s answer: {status, values, reclaimed drafts, riders settled, allowance
    units reclaimed}."""
    status = int(res[0])
    turn = int(res[5]) if len(res) > 5 else 0
    return AdmitResult(
        admitted=status == 1,
        duplicate=status == 2,
        values=tuple(int(v) for v in res[1]),
        reclaimed=reclaimed(res[2] if len(res) > 2 else []),
        settled=tuple(bool(int(v)) for v in (res[3] if len(res) > 3 else [])),
        allowance_reclaimed=int(res[4]) if len(res) > 4 else 0,
        wait=status == 3,
        turn_ms=turn,
        queue_full=len(res) > 6 and int(res[6]) == 1,
    )


# -- charge.lua --------------------------------------------------------------------------------


def add_charge(p: Packed, c: ChargeCall, *, replay: bool = False) -> None:
    """Append one stream charge's KEYS and ARGV slices; ``replay``: marked a journal replay
    ("r": it still applies on a new master that got the request's settlement first)."""
    p.keys.append(c.ledger)
    p.keys += [b.key for b in c.buckets]
    head = len(p.args)
    strict = "r" if replay else "1" if c.strict else "0"
    p.args += [c.seq, c.amount, strict, c.ledger_ttl_ms, len(c.buckets), 0]
    first_prev = len(p.keys)
    for b in c.buckets:
        p.args += [b.limit, b.expire_at_ms, b.rate, int(b.shadow)]
        p.args += _previous(p.keys, b)
    p.args[head + CHARGE_PREV_AT] = len(p.keys) - first_prev


def charges(items: Sequence[ChargeCall]) -> Packed:
    """A ``charge.lua`` call of ``items``, in order."""
    p = Packed([], [len(items)])
    for c in items:
        add_charge(p, c)
    return p


def charge_replay(c: ChargeCall, granted: int) -> Packed:
    """The journal's form of an acknowledged stream charge: the lazy charge of what was
    granted, marked a replay."""
    p = Packed([], [1])
    lazy = ChargeCall(c.ledger, c.seq, c.buckets, granted, False, c.ledger_ttl_ms)
    add_charge(p, lazy, replay=True)
    return p


def charge_result(v: Any) -> ChargeResult:
    """One charge's answer: {granted, over, {value per bucket}}."""
    return ChargeResult(
        granted=int(v[0]), exhausted=bool(int(v[1])), values=tuple(int(x) for x in v[2])
    )


# -- note.lua, input_stop.lua ------------------------------------------------------------------


def notes(items: Sequence[InputNote]) -> Packed:
    """A ``note.lua`` call of ``items``."""
    p = Packed([], [len(items)])
    for note in items:
        p.keys.append(note.ledger)
        p.args += [note.input_tokens, len(note.refund)]
        for key, units in note.refund:
            p.args += [key, units]
    return p


def input_stop(key: str, model: str, entry: str, ttl_ms: int) -> Packed:
    """An ``input_stop.lua`` call."""
    return Packed([key], [model, entry, ttl_ms])
