"""What the sidecar knows of the vLLM model in Triton, as a state machine: every state and every
transition is named here, fed by readiness probes and by the outcome of the loads the catalog
asks for. Plain synchronous code, no I/O: the catalog does the talking, this decides.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)

# An engine is declared lost only on evidence: Triton saying the model is not ready, or this
# many failed probes in a row spanning at least LOST_WINDOW_S (one blip must not unload a
# healthy engine or stop /stage).
LOST_AFTER_FAILURES = 3
LOST_WINDOW_S = 5.0


class EngineState(Enum):
    STARTING = "starting"  # nothing heard from Triton yet
    UNREACHABLE = "unreachable"  # Triton does not answer; no engine is known to serve
    ABSENT = "absent"  # Triton answers; the model is not loaded (never was, unloaded, or lost)
    UNCONFIRMED = "unconfirmed"  # the model is ready, loaded from a catalog not confirmed ours
    SERVING = "serving"  # the model serves generation `loaded`
    SUSPECT = "suspect"  # serving, but the last probes failed; not (yet) declared lost
    LOADING = "loading"  # a load of `target` is in flight (on-change: `loaded` still serves)


class Probe(Enum):
    """A readiness probe's verdict."""

    READY = "ready"  # Triton says the model is ready
    NOT_LOADED = "not_loaded"  # Triton says the model is not ready (unloaded, loading, unknown)
    FAILED = "failed"  # no usable answer: refused, timed out, a server error


class LoadOutcome(Enum):
    OK = "ok"  # Triton answered the load: the target serves
    REFUSED = "refused"  # Triton answered with an error (the engine failed to start)
    UNREACHABLE = "unreachable"  # Triton could not be asked: nothing was restarted


class LoadKind(Enum):
    TAKEOVER = "takeover"  # a plain load of a ready model: a no-op if its files are unchanged
    LOAD = "load"  # nothing serves: load
    RELOAD = "reload"  # a new generation beside the old engine (on-change)
    UNLOAD_FIRST = "unload-first"  # unload the old engine, then load (one engine's memory)


class Transition(Enum):
    """Every named transition; `EngineTracker.last` says which one happened last."""

    FOUND_READY = "found_ready"  # starting/unreachable/absent -> unconfirmed (or serving)
    FOUND_ABSENT = "found_absent"  # starting/unreachable -> absent
    FOUND_UNREACHABLE = "found_unreachable"  # starting -> unreachable
    CONFIRMED = "confirmed"  # unconfirmed -> serving: the catalog file is the one last loaded
    PROBE_OK = "probe_ok"  # suspect -> serving
    PROBE_BLIP = "probe_blip"  # serving -> suspect, suspect -> suspect
    DECLARED_LOST = "declared_lost"  # suspect -> unreachable (evidence over the window)
    MODEL_GONE = "model_gone"  # serving/suspect/unconfirmed -> absent (Triton says so)
    LOAD_STARTED = "load_started"  # any but loading -> loading
    LOAD_DONE = "load_done"  # loading -> serving
    LOAD_REFUSED_OLD_SERVES = "load_refused_old_serves"  # loading -> serving (old generation)
    LOAD_REFUSED = "load_refused"  # loading -> absent / unconfirmed
    LOAD_UNREACHABLE = "load_unreachable"  # loading -> unreachable (nothing restarted)


@dataclass(slots=True)
class EngineTracker:
    """The state, the generations involved, and the evidence gathered so far."""

    clock: Callable[[], float] = time.monotonic
    lost_after: int = LOST_AFTER_FAILURES
    lost_window_s: float = LOST_WINDOW_S
    state: EngineState = EngineState.STARTING
    loaded: int | None = None  # the generation the serving engine lists (None: none serves)
    target: int | None = None  # the generation being loaded
    kind: LoadKind | None = None  # the kind of the load in flight
    failures: int = 0  # probes failed in a row
    first_failure_at: float | None = None
    last_restart_at: float | None = None  # when the last load that reached Triton started
    last_load_failed: bool = False
    last_error: str | None = None
    last: Transition | None = None
    loads_started: int = 0  # a probe answered across a load says nothing about the new engine
    _load_started_at: float | None = None

    # ---- what the catalog asks ---------------------------------------------------------

    def serving(self) -> int | None:
        """The generation whose names requests may use now, or None when no known engine
        serves (in on-change mode the old engine serves while the new one loads)."""
        if self.state in (EngineState.SERVING, EngineState.SUSPECT):
            return self.loaded
        if self.state is EngineState.LOADING and self.kind in (LoadKind.RELOAD,
                                                                LoadKind.TAKEOVER):
            return self.loaded
        return None

    # ---- probes ------------------------------------------------------------------------

    def on_probe(self, probe: Probe, detail: str = "") -> Transition | None:
        """Apply a probe's verdict; returns the transition taken, if any."""
        state = self.state
        if state is EngineState.LOADING:
            return None  # the load's own outcome decides
        if probe is Probe.READY:
            self.failures, self.first_failure_at = 0, None
            if state is EngineState.SUSPECT:
                return self._go(EngineState.SERVING, Transition.PROBE_OK, "probes answer again")
            if state in (EngineState.STARTING, EngineState.UNREACHABLE, EngineState.ABSENT):
                return self._go(EngineState.UNCONFIRMED, Transition.FOUND_READY,
                                "Triton serves the model; the catalog it loaded is to confirm")
            return None
        if probe is Probe.NOT_LOADED:
            self.failures, self.first_failure_at = 0, None
            if state in (EngineState.SERVING, EngineState.SUSPECT, EngineState.UNCONFIRMED):
                self.loaded = None
                return self._go(EngineState.ABSENT, Transition.MODEL_GONE,
                                f"Triton says the model is not ready ({detail})")
            if state in (EngineState.STARTING, EngineState.UNREACHABLE):
                return self._go(EngineState.ABSENT, Transition.FOUND_ABSENT,
                                f"Triton answers; the model is not loaded ({detail})")
            return None
        # Probe.FAILED
        now = self.clock()
        if state is EngineState.STARTING:
            return self._go(EngineState.UNREACHABLE, Transition.FOUND_UNREACHABLE, detail)
        if state not in (EngineState.SERVING, EngineState.SUSPECT):
            return None
        self.failures += 1
        if self.first_failure_at is None:
            self.first_failure_at = now
        if self.failures >= self.lost_after and now - self.first_failure_at >= self.lost_window_s:
            failed_for = now - self.first_failure_at
            self.loaded = None
            self.failures, self.first_failure_at = 0, None
            return self._go(EngineState.UNREACHABLE, Transition.DECLARED_LOST,
                            f"{self.lost_after}+ probes failed over {failed_for:.1f}s ({detail})")
        if state is EngineState.SERVING:
            return self._go(EngineState.SUSPECT, Transition.PROBE_BLIP,
                            f"a probe failed ({detail}); still serving until there is evidence")
        self.last = Transition.PROBE_BLIP
        return Transition.PROBE_BLIP

    def confirm(self, generation: int) -> Transition:
        """The model found ready lists `generation`: the catalog file has held it since Triton
        last confirmed loading it, so whatever Triton loaded since is that file."""
        assert self.state is EngineState.UNCONFIRMED
        self.loaded = generation
        return self._go(EngineState.SERVING, Transition.CONFIRMED,
                        f"generation {generation}, unchanged since it was loaded")

    # ---- loads -------------------------------------------------------------------------

    def start_load(self, generation: int, kind: LoadKind) -> Transition:
        if kind is LoadKind.UNLOAD_FIRST or kind is LoadKind.LOAD:
            self.loaded = None  # nothing serves until the new engine is up
        self.target, self.kind = generation, kind
        self._load_started_at = self.clock()
        self.loads_started += 1
        return self._go(EngineState.LOADING, Transition.LOAD_STARTED,
                        f"{kind.value} of generation {generation}")

    def load_done(self, outcome: LoadOutcome, error: str | None = None) -> Transition:
        assert self.state is EngineState.LOADING and self.target is not None
        target, kind, started = self.target, self.kind, self._load_started_at
        self.target, self.kind, self._load_started_at = None, None, None
        self.failures, self.first_failure_at = 0, None
        if outcome is not LoadOutcome.UNREACHABLE and kind is not LoadKind.TAKEOVER:
            # Only a load that reached Triton can have restarted an engine: the minimum
            # interval between reloads counts from it.
            self.last_restart_at = started
        if outcome is LoadOutcome.OK:
            self.loaded = target
            self.last_load_failed, self.last_error = False, None
            return self._go(EngineState.SERVING, Transition.LOAD_DONE,
                            f"generation {target} serves")
        self.last_error = error
        if outcome is LoadOutcome.UNREACHABLE:
            self.loaded = None
            return self._go(EngineState.UNREACHABLE, Transition.LOAD_UNREACHABLE, error or "")
        self.last_load_failed = True
        if kind is LoadKind.RELOAD and self.loaded is not None:
            return self._go(EngineState.SERVING, Transition.LOAD_REFUSED_OLD_SERVES,
                            f"generation {target} failed to load; {self.loaded} still serves")
        if kind is LoadKind.TAKEOVER:
            # The model was ready before the load; Triton keeps the old instance when a load
            # fails, so something serves, but not a catalog this process can name.
            return self._go(EngineState.UNCONFIRMED, Transition.LOAD_REFUSED, error or "")
        self.loaded = None
        return self._go(EngineState.ABSENT, Transition.LOAD_REFUSED, error or "")

    # ---- helpers -----------------------------------------------------------------------

    def _go(self, state: EngineState, transition: Transition, why: str) -> Transition:
        if state is not self.state:
            log.info("catalog: Triton's vLLM model %s -> %s (%s)", self.state.value, state.value,
                     why)
        self.state = state
        self.last = transition
        return transition
