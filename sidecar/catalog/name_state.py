"""The life of one catalogued name, as a state machine: every state, every event and every
allowed transition is in one table here. Plain code, no I/O: the catalog moves links and writes
the journal, this decides what a name may become.

A name belongs to one adapter version (its id and the digest of its bytes) for the life of its
generation. The engine caches what it read under a name (by the name's position in the
catalog), so a name is never pointed at other bytes once bound: it is parked at a no-op while its
adapter is off the disk and returns when the same bytes are staged again, unless the engine
read the no-op meanwhile (then it is burnt: it would answer as the no-op).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class NameState(Enum):
    UNBOUND = "unbound"  # a spare at its no-op, never handed out; watched for reads
    BOUND = "bound"  # leads to its version's folder under adapters/; handed out
    PARKED = "parked"  # its version left the disk: at its no-op, watched; not handed out
    BURNT = "burnt"  # at its no-op for good: the engine may have cached that no-op under it
    RETIRED = "retired"  # its generation is no longer loaded by any engine


class NameEvent(Enum):
    BIND = "bind"  # a spare is given to a staged version
    LEAVE = "leave"  # the bound version left the disk (evicted, removed by hand)
    RETURN = "return"  # the same bytes were staged again
    READ = "read"  # the engine opened the no-op the name points at
    FAIL = "fail"  # the name could not be kept true (a link not made, bytes changed in place)
    RETIRE = "retire"  # the generation was replaced and its grace has passed


S, E = NameState, NameEvent

TRANSITIONS: dict[tuple[NameState, NameEvent], NameState] = {
    (S.UNBOUND, E.BIND): S.BOUND,
    (S.UNBOUND, E.READ): S.BURNT,
    (S.UNBOUND, E.FAIL): S.BURNT,
    (S.BOUND, E.LEAVE): S.PARKED,
    (S.BOUND, E.FAIL): S.BURNT,
    (S.PARKED, E.RETURN): S.BOUND,
    (S.PARKED, E.READ): S.BURNT,
    (S.PARKED, E.FAIL): S.BURNT,
    (S.BURNT, E.READ): S.BURNT,  # read again: nothing changes
    (S.BURNT, E.FAIL): S.BURNT,
    **{(state, E.RETIRE): S.RETIRED for state in (S.UNBOUND, S.BOUND, S.PARKED, S.BURNT)},
}
# Handed out to a request: only these lead to the bytes a request asks for.
SERVABLE = frozenset({S.BOUND})
# The no-op is what the engine would read under these: their no-op folders are watched.
WATCHED = frozenset({S.UNBOUND, S.PARKED})
# A version keeps its name through these (it may return to it).
HELD = frozenset({S.BOUND, S.PARKED})


class BadTransition(ValueError):
    """An event a name in that state cannot take (a bug in the caller, never a user error)."""


def next_state(state: NameState, event: NameEvent) -> NameState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise BadTransition(f"a {state.value} name cannot {event.value}") from None


@dataclass(frozen=True, slots=True)
class Version:
    """An adapter as the engine would read it: its id and the digest of its bytes."""

    adapter_id: str
    digest: str

    def __str__(self) -> str:
        return f"{self.adapter_id}@{self.digest.split(':', 1)[-1][:12]}"
