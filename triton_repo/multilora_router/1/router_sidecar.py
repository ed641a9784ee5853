"""The router's two calls to the sidecar, POST /stage and /release, each bounded in time; the
lease a stage answers, and what it says of the adapter bytes that will answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from router_connections import Connections, Unreachable
from router_errors import Retry, RouteError, Status, sidecar_error
from router_retries import Backoff, Clock, Pause
from router_settings import RouterSettings

PROVENANCE = ("content_digest", "signer", "signer_identity")


@dataclass(frozen=True, slots=True)
class Lease:
    adapter_id: str
    lease_id: str
    path: str
    cached: bool
    lora_name: str  # the name vllm_model knows the adapter by: its id, or a spare catalog name
    # Which bytes answer (`sha256:` of the files' SHA256SUMS text) and who signed them, when the
    # sidecar's signing policy verified a signature: on the router's response and in its log.
    content_digest: str | None = None
    signer: str | None = None
    signer_identity: str | None = None

    @classmethod
    def from_answer(cls, body: Mapping[str, Any]) -> Lease:
        """From the sidecar's /stage answer."""
        try:
            return cls(str(body["adapter_id"]), str(body["lease_id"]), str(body["path"]),
                       bool(body.get("cached", False)),
                       str(body.get("lora_name") or body["adapter_id"]),
                       _text_or_none(body.get("content_digest")),
                       _text_or_none(body.get("signer")),
                       _text_or_none(body.get("signer_identity")))
        except KeyError as exc:
            raise RouteError(Status.INTERNAL,
                             f"sidecar's /stage answer has no {exc.args[0]!r}") from exc


def provenance(lease: Lease) -> dict[str, str]:
    """What the router's response says of the adapter bytes that answered (response parameters,
    and output tensors of the same names): "" where the sidecar said nothing (no signature)."""
    return {"content_digest": lease.content_digest or "", "signer": lease.signer or "",
            "signer_identity": lease.signer_identity or ""}


def provenance_line(request_id: str, lease: Lease) -> str:
    """The router's log line for an answered request: the request id with those facts."""
    facts = provenance(lease)
    return (f"multilora_router answered request_id={request_id or '-'} "
            f"adapter_id={lease.adapter_id} lora_name={lease.lora_name} "
            + " ".join(f"{key}={facts[key] or '-'}" for key in PROVENANCE))


class SidecarClient:
    """POST /stage and /release to the sidecar over keep-alive HTTP. Safe to share between
    threads."""

    def __init__(self, settings: RouterSettings, clock: Clock = time.monotonic,
                 pause: Pause = time.sleep) -> None:
        self.settings = settings
        self._clock = clock
        self._pause = pause
        self._connections = Connections(settings.sidecar_url, clock)
        self._headers = {"Content-Type": "application/json"}
        if settings.api_token:
            self._headers["Authorization"] = f"Bearer {settings.api_token}"

    @property
    def connections_opened(self) -> int:
        """For tests and benchmarks: how often a call had to connect."""
        return self._connections.opened

    @contextmanager
    def leased(self, adapter_id: str, warn: Callable[[str], None]) -> Iterator[Lease]:
        """A lease on `adapter_id` for the block, released after it whatever happens; a failed
        release is only a warning (the lease expires on its own, the sidecar's --lease-ttl)."""
        lease = self.stage(adapter_id)
        try:
            yield lease
        finally:
            try:
                self.release(lease.lease_id)
            except RouteError as exc:
                warn(f"could not release lease {lease.lease_id} of {adapter_id}: {exc.message}")

    def stage(self, adapter_id: str) -> Lease:
        """Stage `adapter_id`, waiting out a cache full of leased adapters until the deadline."""
        backoff = Backoff(self.settings.stage_timeout_s, self._clock, self._pause)
        while True:
            remaining_s = max(backoff.remaining_s, 0.001)
            try:
                # The sidecar's own timeout runs out first, so a slow download is answered
                # with its stage_timeout error rather than with a socket timeout here.
                body = self._post("/stage", {"adapter_id": adapter_id, "timeout_s": remaining_s},
                                  timeout_s=remaining_s + self.settings.sidecar_timeout_s)
            except RouteError as exc:
                # A cache full of leased adapters clears as soon as a lease is released.
                if exc.retry is not Retry.WHEN_ROOM or not backoff.pause():
                    raise
                continue
            return Lease.from_answer(body)

    def release(self, lease_id: str) -> None:
        self._post("/release", {"lease_id": lease_id}, timeout_s=self.settings.sidecar_timeout_s)

    def close(self) -> None:
        self._connections.close()

    def _post(self, path: str, payload: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        try:
            status, raw = self._connections.post(path, json.dumps(payload).encode(),
                                                 self._headers, timeout_s)
        except Unreachable as exc:
            raise RouteError(
                Status.UNAVAILABLE,
                f"sidecar unreachable at {self.settings.sidecar_url} ({path}): {exc}; "
                "check that lora-sidecar is running and the router's sidecar_url",
            ) from exc
        body = _json_object(raw)
        if status >= 400:
            raise sidecar_error(status, body, payload.get("adapter_id"))
        return body


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        snippet = raw[:200].decode("utf-8", "replace")
        raise RouteError(Status.INTERNAL, f"sidecar answered something not JSON: {snippet!r}")
    return value
