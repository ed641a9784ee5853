"""A catalog generation's names and what each belongs to, and the journal of every live
generation: plain data with its indexes and its JSON form, no I/O. Every change of a name goes
through `Generation.apply`, which asks the state machine (name_state.py) and keeps the indexes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.ids import is_valid_adapter_id
from .name_state import HELD, NameEvent, NameState, Version, next_state

JOURNAL_FORMAT = 2
SPARE_PREFIX = "_spare-g"  # '_' cannot start an adapter id, so a spare never shadows one


def spare_name(generation: int, index: int) -> str:
    """`_spare-g7-0003`: unique across generations, so a name handed out for one engine is
    refused by the next one ("not supported") instead of reaching another adapter there."""
    return f"{SPARE_PREFIX}{generation}-{index:04d}"


@dataclass(slots=True)
class Entry:
    """One catalogued name: its state, the version it belongs to (None while unbound), whether it
    is a spare (else it is an adapter's own id), and why it last changed."""

    state: NameState
    version: Version | None
    spare: bool
    why: str = ""


@dataclass(slots=True)
class Counts:
    """What happened to a generation's names, for GET /catalog and the metrics."""

    bound: int = 0  # spares given to a version
    parked: int = 0  # names whose version left the disk
    returned: int = 0  # parked names whose bytes came back
    burnt: int = 0


class Generation:
    """One rendered generation. The hit path asks `serving_name` (two dict lookups)."""

    __slots__ = (
        "_encoded",
        "_free",
        "_held",
        "_on_disk",
        "_own",
        "_pending",
        "_spares",
        "_states",
        "counts",
        "names",
        "number",
        "rendered_at",
        "retire_at",
    )

    def __init__(self, number: int, names: Mapping[str, Entry], rendered_at: float,
                 retire_at: float | None = None, counts: Counts | None = None) -> None:
        self.number = number
        self.rendered_at = rendered_at  # unix
        self.retire_at = retire_at  # unix; the folder is deleted after it
        self.names: dict[str, Entry] = dict(names)  # in multi_lora.json's order
        self.counts = counts or Counts()
        # adapter id -> {version: its bound or parked name}
        self._held: dict[str, dict[Version, str]] = {}
        self._on_disk: dict[str, str] = {}  # adapter id -> its bound name (one version on disk)
        self._free: dict[str, None] = {}  # unbound spares, in order
        self._pending: set[str] = set()  # bound, their link not switched or not durable yet
        # name -> its entry in the journal's text, dropped when `apply` changes it: a save
        # encodes the names that changed, not thousands of spares (journal_text).
        self._encoded: dict[str, str] = {}
        # A generation's names and which are spares never change after it is made; the names
        # in each state are counted as `apply` moves them (the gauges, after every change).
        self._own = frozenset(name for name, entry in self.names.items() if not entry.spare)
        self._spares = len(self.names) - len(self._own)
        self._states: dict[NameState, int] = dict.fromkeys(NameState, 0)
        for name, entry in self.names.items():
            self._index(name, entry)

    @classmethod
    def render(cls, number: int, versions: Iterable[Version], spares: int,
               rendered_at: float) -> Generation:
        """Every version given by its adapter's own name (bound from the start), then
        `spares` unbound spare names."""
        names: dict[str, Entry] = {
            v.adapter_id: Entry(NameState.BOUND, v, False, "on disk when rendered")
            for v in sorted(versions, key=lambda v: v.adapter_id)}
        for i in range(1, spares + 1):
            names[spare_name(number, i)] = Entry(NameState.UNBOUND, None, True)
        return cls(number, names, rendered_at)

    # ---- lookups ------------------------------------------------------------------------

    def serving_name(self, adapter_id: str, digest: str) -> str | None:
        """The bound name of this version, if it has one and its link leads to it (the hit
        path)."""
        name = self._on_disk.get(adapter_id)
        if name is None or name in self._pending:
            return None
        version = self.names[name].version
        return name if version is not None and version.digest == digest else None

    def held_name(self, version: Version) -> str | None:
        """The name this version is bound or parked under, if any."""
        return self._held.get(version.adapter_id, {}).get(version)

    def held_names_of(self, adapter_id: str) -> dict[Version, str]:
        """Every version of this id that holds a name here (a miss's question)."""
        return dict(self._held.get(adapter_id, {}))

    def bound_name_of(self, adapter_id: str) -> str | None:
        """The name whatever version of this id is on disk is bound under."""
        return self._on_disk.get(adapter_id)

    def free_spares(self) -> list[str]:
        return list(self._free)

    def free_count(self) -> int:
        return len(self._free)

    def in_state(self, *states: NameState) -> list[str]:
        return [name for name, entry in self.names.items() if entry.state in states]

    def own_ids(self) -> frozenset[str]:
        """Adapter ids listed by their own names."""
        return self._own

    def spare_count(self) -> int:
        return self._spares

    def count_in(self, state: NameState) -> int:
        return self._states[state]

    def state_counts(self) -> dict[str, int]:
        """Names by state (retired ones left out)."""
        return {state.value: count for state, count in self._states.items()
                if state is not NameState.RETIRED}

    # ---- changes ------------------------------------------------------------------------

    def apply(self, name: str, event: NameEvent, why: str,
              version: Version | None = None, pending: bool = False) -> Entry:
        """Move a name through the state machine (BadTransition if it cannot take `event`);
        BIND needs the version. `pending`: bound in the journal, but its link still leads to
        its no-op, or is not durable yet: never answered until `linked()`. Returns the entry
        as it is now."""
        entry = self.names[name]
        self._encoded.pop(name, None)
        self._pending.discard(name)
        if pending:
            self._pending.add(name)
        before = entry.state
        state = next_state(before, event)
        self._unindex(name, entry)
        if event is NameEvent.BIND:
            assert version is not None, "a binding needs the version"
            entry.version = version
        entry.state, entry.why = state, why
        self._index(name, entry)
        counts = self.counts
        if event is NameEvent.BIND:
            counts.bound += 1
        elif event is NameEvent.LEAVE:
            counts.parked += 1
        elif event is NameEvent.RETURN:
            counts.returned += 1
        if state is NameState.BURNT and before is not NameState.BURNT:
            counts.burnt += 1
        return entry

    def is_pending(self, name: str) -> bool:
        return name in self._pending

    def linked(self, name: str) -> None:
        """A bound name's link leads to its version now: it may be answered."""
        self._pending.discard(name)

    def _index(self, name: str, entry: Entry) -> None:
        self._states[entry.state] += 1
        if entry.state is NameState.UNBOUND:
            self._free[name] = None
        if entry.version is not None and entry.state in HELD:
            self._held.setdefault(entry.version.adapter_id, {})[entry.version] = name
            if entry.state is NameState.BOUND:
                self._on_disk[entry.version.adapter_id] = name

    def _unindex(self, name: str, entry: Entry) -> None:
        self._states[entry.state] -= 1
        self._free.pop(name, None)
        if entry.version is not None:
            of_id = self._held.get(entry.version.adapter_id, {})
            if of_id.get(entry.version) == name:
                del of_id[entry.version]
                if not of_id:
                    del self._held[entry.version.adapter_id]
            if self._on_disk.get(entry.version.adapter_id) == name:
                del self._on_disk[entry.version.adapter_id]

    # ---- the journal's form -------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "rendered_at": self.rendered_at,
            "retire_at": self.retire_at,
            "counts": self._counts_json(),
            "names": [_entry_json(name, e) for name, e in self.names.items()],
        }

    def journal_text(self) -> str:
        """`json.dumps(self.to_json(), separators=(",", ":"))`, with each name's text kept
        from the last save it did not change in: a generation of 4,096 spares took 4 ms to
        encode whole, on the loop, at every binding (benchmarks/catalog_journal.py)."""
        encoded = self._encoded
        names = []
        for name, entry in self.names.items():
            text = encoded.get(name)
            if text is None:
                text = encoded[name] = _compact(_entry_json(name, entry))
            names.append(text)
        head = _compact({"rendered_at": self.rendered_at, "retire_at": self.retire_at,
                         "counts": self._counts_json()})
        return f'{head[:-1]},"names":[{",".join(names)}]}}'

    def _counts_json(self) -> dict[str, int]:
        return {"bound": self.counts.bound, "parked": self.counts.parked,
                "returned": self.counts.returned, "burnt": self.counts.burnt}

    @classmethod
    def from_json(cls, number: int, data: Mapping[str, Any]) -> Generation:
        """ValueError when the data cannot be trusted."""
        names: dict[str, Entry] = {}
        raw = data["names"]
        if not isinstance(raw, list):
            raise ValueError(f"generation {number}: names is not a list")
        for item in raw:
            name, spare = item["name"], item["spare"]
            state = NameState(item["state"])
            if not isinstance(name, str) or name in names or not isinstance(spare, bool):
                raise ValueError(f"generation {number}: a bad or repeated name")
            if spare != name.startswith(f"{SPARE_PREFIX}{number}-") or (
                    not spare and not is_valid_adapter_id(name)):
                raise ValueError(f"generation {number}: {name!r} is not a name of it")
            version = None
            if "adapter_id" in item:
                adapter_id, digest = item["adapter_id"], item["digest"]
                if not (is_valid_adapter_id(adapter_id) and isinstance(digest, str)):
                    raise ValueError(f"generation {number}: a bad version for {name!r}")
                version = Version(adapter_id, digest)
            if (state is NameState.UNBOUND and version is not None) or (
                    state in HELD and version is None):
                raise ValueError(f"generation {number}: {name!r} is {state.value} "
                                 f"{'without' if version is None else 'with'} a version")
            names[name] = Entry(state, version, spare, str(item.get("why", "")))
        counts = Counts(**{k: int(v) for k, v in data.get("counts", {}).items()
                           if k in ("bound", "parked", "returned", "burnt")})
        retire_at = data.get("retire_at")
        return cls(number, names, float(data["rendered_at"]),
                   float(retire_at) if retire_at is not None else None, counts)


@dataclass(slots=True)
class CatalogJournal:
    """Every generation whose folder exists, the one multi_lora.json holds (`current`), and
    the last one Triton confirmed it loaded (`loaded`)."""

    generations: dict[int, Generation] = field(default_factory=dict)
    current: int | None = None
    loaded: int | None = None

    def current_generation(self) -> Generation | None:
        return self.generations.get(self.current) if self.current is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": JOURNAL_FORMAT, "current": self.current, "loaded": self.loaded,
            "generations": {str(n): g.to_json() for n, g in sorted(self.generations.items())},
        }

    def journal_text(self) -> str:
        """`json.dumps(self.to_json(), separators=(",", ":"))`, each generation's names
        encoded only where they changed (`Generation.journal_text`)."""
        head = _compact({"format": JOURNAL_FORMAT, "current": self.current,
                         "loaded": self.loaded})
        generations = ",".join(f"{_compact(str(n))}:{g.journal_text()}"
                               for n, g in sorted(self.generations.items()))
        return f'{head[:-1]},"generations":{{{generations}}}}}'

    @classmethod
    def from_json(cls, data: object) -> CatalogJournal:
        if not isinstance(data, dict) or data.get("format") != JOURNAL_FORMAT:
            raise ValueError("not a journal of a known format")
        generations = {int(n): Generation.from_json(int(n), g)
                       for n, g in data["generations"].items()}
        current, loaded = data.get("current"), data.get("loaded")
        for number in (current, loaded):
            if number is not None and number not in generations:
                raise ValueError(f"generation {number} is named but not recorded")
        return cls(generations, current, loaded)


def _entry_json(name: str, entry: Entry) -> dict[str, Any]:
    return {"name": name, "state": entry.state.value, "spare": entry.spare,
            "why": entry.why[:300],
            **({"adapter_id": entry.version.adapter_id, "digest": entry.version.digest}
               if entry.version else {})}


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))
