"""The sidecar's error vocabulary: every failure a caller can see, with a stable code, and what
a client of the router should see of it (the Triton status, the message, whether asking again
can help), so that nothing on the far side of the wire keeps a copy of this ladder.

`web/api.py` maps each class to an HTTP status in one table; the `code` is what clients match on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The Triton statuses (names of the Python backend's TritonError codes) a client can see.
# UNAVAILABLE is the one a routing proxy retries on another node, so it is kept for what another
# node, or this one later, can help with; what is wrong with the adapter or the request itself
# is never UNAVAILABLE, since every node would answer the same.
NOT_FOUND = "NOT_FOUND"
INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"  # the deployment, not the request: credentials, tokens, a wrong URL


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose."""

    code = "internal_error"
    triton_status = INTERNAL
    retry_helps = False  # whether asking again (later, or another node) can help

    def __init__(self, message: str, *, adapter_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.adapter_id = adapter_id
        # Set by the one that logged it (the stager, for a failed stage), so the API does not
        # log it again for each caller it answers.
        self.logged = False

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.code, "message": self.message}
        if self.adapter_id is not None:
            body["adapter_id"] = self.adapter_id
        body.update(self.extra())
        body.update(triton_status=self.triton_status, triton_message=self.client_message(),
                    retryable=self.retry_helps)
        return body

    def extra(self) -> Mapping[str, Any]:
        return {}

    def client_message(self) -> str:
        """What a client of the router reads: the message, with the code to match on."""
        return f"{self.message} ({self.code})"


class ConfigError(Exception):
    """Bad settings; carries every problem found, not just the first. Not a SidecarError: it
    stops the start (exit code 2) and never reaches an API caller."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        self.message = "invalid configuration:\n  - " + "\n  - ".join(self.problems)
        super().__init__(self.message)


class BadRequest(SidecarError):
    """The request itself is malformed: not JSON, wrong fields, wrong types."""

    code = "invalid_request"
    triton_status = INVALID_ARG


class InvalidAdapterId(SidecarError):
    code = "invalid_adapter_id"
    triton_status = INVALID_ARG


class Unauthorized(SidecarError):
    code = "unauthorized"


class Forbidden(SidecarError):
    """A known token asked for what it may not do: a tenant's for another tenant's id, the
    router's for anything but a stage."""

    code = "forbidden"


class AdapterNotFound(SidecarError):
    """The registry has no adapter under this id."""

    code = "adapter_not_found"
    triton_status = NOT_FOUND


class NotCached(SidecarError):
    """The adapter exists (or may exist) in the registry but is not on local disk."""

    code = "not_cached"


class LeaseNotFound(SidecarError):
    code = "lease_not_found"


class AdapterInUse(SidecarError):
    """Eviction refused: the adapter is pinned or leased."""

    code = "adapter_in_use"

    def __init__(self, message: str, *, adapter_id: str, pinned: bool, lease_ids: Sequence[str]):
        super().__init__(message, adapter_id=adapter_id)
        self.pinned = pinned
        self.lease_ids = list(lease_ids)

    def extra(self) -> Mapping[str, Any]:
        return {"pinned": self.pinned, "leases": len(self.lease_ids)}


class InvalidAdapter(SidecarError):
    """Validation refused the adapter; `problems` lists every reason found."""

    code = "invalid_adapter"
    triton_status = INVALID_ARG

    def __init__(self, adapter_id: str, problems: Sequence[Mapping[str, str]], *,
                 remembered: bool = False, refused_at: str | None = None,
                 remembered_until: str | None = None) -> None:
        self.problems = [dict(p) for p in problems]
        self.remembered = remembered  # answered from memory, not from a fresh look
        self.refused_at = refused_at  # ISO 8601 UTC
        self.remembered_until = remembered_until  # None: not remembered at all
        summary = "; ".join(f"{p['file']}: {p['message']}" for p in self.problems[:5])
        more = f" (+{len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        if remembered:
            head = f"adapter {adapter_id} was refused by validation at {refused_at}"
            tail = (f". This is that remembered verdict for the same files in the registry, "
                    f"kept until {remembered_until} (--refusal-ttl); a new upload of the "
                    "adapter is judged afresh as soon as it is listed")
        else:
            head = f"adapter {adapter_id} was refused by validation"
            tail = "" if remembered_until is None else (
                f". The verdict is remembered for these files until {remembered_until} "
                "(--refusal-ttl); a new upload is judged afresh at once")
        super().__init__(f"{head}: {summary}{more}{tail}", adapter_id=adapter_id)

    def recalled(self) -> InvalidAdapter:
        """The same verdict, answered again from memory."""
        assert self.adapter_id is not None
        return InvalidAdapter(self.adapter_id, self.problems, remembered=True,
                              refused_at=self.refused_at, remembered_until=self.remembered_until)

    def extra(self) -> Mapping[str, Any]:
        return {"problems": self.problems, "remembered": self.remembered,
                "refused_at": self.refused_at, "remembered_until": self.remembered_until}

    def client_message(self) -> str:
        """Every problem, each with its code (`rank_too_large`, ...)."""
        listed = "; ".join(f"{p.get('file', '?')}: {p.get('message', '?')} [{p.get('code', '?')}]"
                           for p in self.problems)
        return f"adapter {self.adapter_id} was refused by validation: {listed} ({self.code})"


class RegistryUnavailable(SidecarError):
    """The registry could not be reached or did not answer in time (retryable)."""

    code = "registry_unavailable"
    triton_status = UNAVAILABLE
    retry_helps = True

    def __init__(self, message: str, *, adapter_id: str | None = None, cause: str = "unknown",
                 retryable: bool = True):
        super().__init__(message, adapter_id=adapter_id)
        self.cause = cause
        self.retryable = retryable  # false once the storage client spent its own attempts

    def extra(self) -> Mapping[str, Any]:
        return {"cause": self.cause}

    def client_message(self) -> str:
        return f"{self.message} [cause: {self.cause}] ({self.code})"


class RegistryTransient(RegistryUnavailable):
    """The bytes did not arrive intact on any fresh download (a checksum that disagrees with
    the registry's own, a file that cannot be read back): retryable, and never remembered as a
    verdict on the adapter."""

    code = "registry_transient"


class RegistryError(SidecarError):
    """The registry answered, but with a refusal: credentials, permissions, missing bucket."""

    code = "registry_error"

    def __init__(self, message: str, *, adapter_id: str | None = None, cause: str = "unknown"):
        super().__init__(message, adapter_id=adapter_id)
        self.cause = cause

    def extra(self) -> Mapping[str, Any]:
        return {"cause": self.cause}

    def client_message(self) -> str:
        return f"{self.message} [cause: {self.cause}] ({self.code})"


class RegistryObjectChanged(RegistryError):
    """An object changed between listing and fetch (etag or size moved under us)."""

    code = "registry_object_changed"
    triton_status = UNAVAILABLE
    retry_helps = True


class StageTimeout(SidecarError):
    """The caller's `timeout_s` ran out; the download may go on for other callers."""

    code = "stage_timeout"
    triton_status = UNAVAILABLE
    retry_helps = True


class CacheFull(SidecarError):
    """The adapter cannot fit in the byte/count budget or on the disk. `retryable` is false
    when waiting cannot help (larger than the budget, or the room is held by pins)."""

    code = "cache_full"
    triton_status = UNAVAILABLE

    def __init__(self, message: str, *, adapter_id: str | None = None, retryable: bool = True):
        super().__init__(message, adapter_id=adapter_id)
        self.retryable = retryable
        self.retry_helps = retryable



class CatalogPending(SidecarError):
    """Staged, but the model server has not loaded a catalog that lists this adapter yet."""

    code = "catalog_pending"
    triton_status = UNAVAILABLE
    retry_helps = True


class CatalogReloading(SidecarError):
    """The model server is reloading its catalog; the adapter will be servable after it."""

    code = "catalog_reloading"
    triton_status = UNAVAILABLE
    retry_helps = True


class CatalogDisabled(SidecarError):
    """A catalog call to a sidecar that renders no catalog."""

    code = "catalog_disabled"


class CacheUnwritable(SidecarError):
    """The cache volume refuses writes (read-only, permissions)."""

    code = "cache_not_writable"
    triton_status = UNAVAILABLE  # another node can help


class NotReady(SidecarError):
    code = "not_ready"
    triton_status = UNAVAILABLE
    retry_helps = True


class EngineUnavailable(SidecarError):
    """The engine refused a name it was given, and what refused it will end: a reload, a
    catalog not loaded yet, an engine being restarted."""

    code = "engine_unavailable"
    triton_status = UNAVAILABLE
    retry_helps = True


class EngineFailed(SidecarError):
    """The engine failed on the request itself: asking again is answered the same."""

    code = "engine_failed"


# What the HTTP layer itself refuses, before any handler runs.


class NoSuchEndpoint(SidecarError):
    code = "not_found"


class MethodNotAllowed(SidecarError):
    code = "method_not_allowed"


class RequestTimeout(SidecarError):
    """The request body did not arrive in time."""

    code = "request_timeout"
    triton_status = UNAVAILABLE
    retry_helps = True


class RequestTooLarge(SidecarError):
    code = "request_too_large"


class CacheOwned(Exception):
    """Another process owns the cache root: this one must not start, and touches nothing. Not
    a SidecarError: it stops the start (exit code 3) and never reaches an API caller."""

    def __init__(self, message: str, *, cache_root: Path, owner: object = None) -> None:
        super().__init__(message)
        self.message = message
        self.cache_root = cache_root
        self.owner = owner
