"""HTTP API: thin aiohttp handlers over the stager and the store. Errors become JSON in one
place (`json_errors`, wrapped around each route), with their status from one table.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NoReturn, Protocol, TypeVar

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from ..cache.lru import CachedAdapter
from ..cache.stager import Stager
from ..cache.store import AdapterStore
from ..catalog.engine_refusal import EngineRefusal
from ..catalog.naming import Named
from ..config import Settings
from ..core.errors import (
    AdapterInUse,
    AdapterNotFound,
    BadRequest,
    CacheFull,
    CacheUnwritable,
    CatalogDisabled,
    CatalogPending,
    CatalogReloading,
    EngineFailed,
    EngineUnavailable,
    Forbidden,
    InvalidAdapter,
    InvalidAdapterId,
    LeaseNotFound,
    MethodNotAllowed,
    NoSuchEndpoint,
    NotCached,
    NotReady,
    RegistryError,
    RegistryObjectChanged,
    RegistryUnavailable,
    RequestTimeout,
    RequestTooLarge,
    SidecarError,
    StageTimeout,
    Unauthorized,
)
from ..core.fsutil import iso_utc
from ..core.ids import check_adapter_id
from ..core.metrics import CONTENT_TYPE, Metrics
from .epp import EppExporter
from .tenants import NO_TENANTS, ROUTER, Tenant, Tenants

log = logging.getLogger(__name__)

STATUS: dict[type[SidecarError], int] = {
    BadRequest: 400,
    InvalidAdapterId: 400,
    Unauthorized: 401,
    Forbidden: 403,
    AdapterNotFound: 404,
    NotCached: 404,
    LeaseNotFound: 404,
    NoSuchEndpoint: 404,
    MethodNotAllowed: 405,
    RequestTimeout: 408,
    AdapterInUse: 409,
    CatalogDisabled: 409,
    RequestTooLarge: 413,
    InvalidAdapter: 422,
    EngineFailed: 502,
    RegistryObjectChanged: 502,
    RegistryError: 502,
    RegistryUnavailable: 503,
    CatalogPending: 503,
    CatalogReloading: 503,
    CacheUnwritable: 503,
    EngineUnavailable: 503,
    NotReady: 503,
    StageTimeout: 504,
    CacheFull: 507,
}

# What aiohttp's own refusals become (a status it answers that is not here: internal_error).
_HTTP_ERRORS: dict[int, type[SidecarError]] = {
    400: BadRequest, 404: NoSuchEndpoint, 405: MethodNotAllowed, 408: RequestTimeout,
    413: RequestTooLarge,
}
# A request body (at most --max-request-bytes, from a local caller) that has not fully arrived
# by then never will: the handler stops waiting rather than hold its task open.
BODY_READ_TIMEOUT_S = 30.0
RECOVERY_WAIT_S = 30.0  # longest a call other than /stage waits for the start-up recovery


def status_of(error: SidecarError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


class Readiness(Protocol):
    def problems(self) -> list[str]: ...

    def notices(self) -> list[str]: ...


class RegistryListingView(Protocol):
    def status(self) -> dict[str, Any]: ...


class CatalogView(Protocol):
    def status(self) -> dict[str, Any]: ...

    def request_compaction(self) -> dict[str, Any]: ...

    def replaced(self, adapter_id: str) -> dict[str, Any] | None: ...


class StageAndName(Protocol):
    def hit(self, adapter_id: str, *, lease: bool) -> Named | None: ...

    async def stage(self, adapter_id: str, *, timeout_s: float, lease: bool, hold_s: float,
                    refused: EngineRefusal | None) -> Named: ...


@dataclass(slots=True)
class Services:
    settings: Settings
    store: AdapterStore
    stager: Stager
    naming: StageAndName  # POST /stage's use case (catalog/naming.py)
    metrics: Metrics
    readiness: Readiness
    catalog: CatalogView | None = None
    recovered: asyncio.Event | None = None  # None: nothing to recover (set up in tests)
    epp: EppExporter | None = None  # /metrics/epp, when --epp-metrics is on
    registry_listing: RegistryListingView | None = None  # the last listing, shown by /catalog
    tenants: Tenants = NO_TENANTS  # --tenants: tokens per adapter-id prefix
    triton_adapters_prefix: str = field(init=False)
    local_adapters_prefix: str = field(init=False)
    stage_fragments: dict[str, tuple[CachedAdapter, str]] = field(init=False, default_factory=dict)
    stage_bodies: dict[bytes, Mapping[str, Any]] = field(init=False, default_factory=dict)
    metrics_handler: Handler = field(init=False)

    def __post_init__(self) -> None:
        # GET /metrics: prometheus_client's own handler, in the format the scraper asks for.
        self.metrics_handler = make_aiohttp_handler(self.metrics.metrics_registry,
                                                    disable_compression=True)
        self.triton_adapters_prefix = f"{self.settings.triton_root / 'adapters'}/"
        self.local_adapters_prefix = f"{self.store.adapters_dir}/"


SERVICES = web.AppKey("services", Services)
# What `text=..., content_type=` would set, given whole: aiohttp parses less (hit path).
JSON_HEADERS = {"Content-Type": "application/json; charset=utf-8"}
STAGE_FRAGMENTS_MAX = 4096  # encoded /stage answers kept, one per adapter id
STAGE_BODIES_MAX = 4096  # /stage request bodies kept checked, by their bytes
STAGE_BODY_KEPT_BYTES = 256  # the longest kept: an id and a few options, not a refusal's text
_K = TypeVar("_K")
_V = TypeVar("_V")


# ---- request parsing -------------------------------------------------------------------

_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "stage": {"adapter_id": (str,), "timeout_s": (int, float), "lease": (bool,),
              "hold_s": (int, float), "engine_refused": (dict, type(None))},
    "release": {"lease_id": (str,)},
    "evict": {"adapter_id": (str,), "force": (bool,)},
    "pin": {"adapter_id": (str,), "timeout_s": (int, float)},
    "unpin": {"adapter_id": (str,)},
    "compact": {},
}
_REQUIRED = {"stage": "adapter_id", "release": "lease_id", "evict": "adapter_id",
             "pin": "adapter_id", "unpin": "adapter_id", "compact": None}


async def _read_body(request: web.Request) -> bytes:
    """A body still arriving, waited for (`_body` takes one that has arrived)."""
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(reason=f"the request body did not arrive within "
                                            f"{BODY_READ_TIMEOUT_S:g}s") from None
    except ConnectionError:
        # The caller hung up part-way: an answer of our own (which has no one to reach), not
        # an exception that aiohttp would log as a server error.
        raise BadRequest("the connection closed before the request body arrived") from None


async def _body(request: web.Request, services: Services, kind: str) -> Mapping[str, Any]:
    """The JSON object of a request, checked against the endpoint's fields and types."""
    body = _body_at_hand(request, services, kind)
    return body if body is not None else _checked_body(services, await _read_body(request),
                                                       kind)


def _body_at_hand(request: web.Request, services: Services,
                  kind: str) -> Mapping[str, Any] | None:
    """`_body` when the body has arrived (the usual case: it came with the head): taken as it
    lies, without the coroutines of `request.read()`, a timer or a coroutine of its own (hit
    path); None while it is still arriving. The headers are judged first either way."""
    # The header as sent is compared first: parsing it is for the rare other spelling.
    if (request.headers.get("Content-Type") != "application/json"
            and request.content_type != "application/json"):
        # Strict on purpose: a browser cannot send this type cross-site without a preflight.
        raise BadRequest(f"send JSON with 'Content-Type: application/json', not "
                         f"{request.content_type!r}")
    declared = request.content_length
    limit = services.settings.max_request_bytes
    if declared is not None and declared > limit:  # at once, not after reading up to the cap
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=declared)
    content = request.content
    if not content.is_eof():
        return None
    raw = content.read_nowait()
    while not content.at_eof():  # a buffer refilled as it was drained
        raw += content.read_nowait()
    if len(raw) > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
    return _checked_body(services, raw, kind)


def _checked_body(services: Services, raw: bytes, kind: str) -> Mapping[str, Any]:
    """`_checked`, kept for /stage's short bodies: a caller such as the router sends the same
    bytes for an adapter every time, and parsing and checking them again was 1.5 of a hit's 13 µs
    of own work, 6-10 µs per hit under load (hit path; benchmarks/README.md). One object serves
    every request that sent the same bytes, so it is read-only; a body that fails its check
    raises and is never kept."""
    if kind != "stage" or len(raw) > STAGE_BODY_KEPT_BYTES:
        return _checked(raw, kind)
    body = services.stage_bodies.get(raw)
    if body is None:
        body = _keep(services.stage_bodies, raw, MappingProxyType(_checked(raw, kind)),
                     STAGE_BODIES_MAX)
    return body


def _keep(table: dict[_K, _V], key: _K, value: _V, limit: int) -> _V:
    """`table[key] = value`, the table emptied first when it holds `limit` entries: a bound
    without bookkeeping, for values that are cheap to make again (hit path)."""
    if len(table) >= limit:
        table.clear()
    table[key] = value
    return value


def _checked(raw: bytes, kind: str) -> dict[str, Any]:
    """The request body's JSON object, checked against the endpoint's fields and types."""
    try:
        body = _parse_json(raw or b"null")
    except (ValueError, RecursionError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    fields = _FIELDS[kind]
    if not body.keys() <= fields.keys():  # compared without building a set (hit path)
        unknown = body.keys() - fields.keys()
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, sorted(unknown)))[:200]}; "
                         f"expected {', '.join(fields)}")
    required = _REQUIRED[kind]
    if required is not None and required not in body:
        raise BadRequest(f"missing field {required!r}")
    for name, value in body.items():
        types = fields[name]
        # bool is an int in Python; a number field must not accept true/false.
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise BadRequest(f"field {name!r} must be of type {types[0].__name__}")
    timeout = body.get("timeout_s")
    if timeout is not None and not 0 < timeout <= 24 * 3600:
        raise BadRequest("timeout_s must be greater than 0 and at most 86400")
    hold = body.get("hold_s")
    if hold is not None and not 0 <= hold <= 24 * 3600:
        raise BadRequest("hold_s must be 0 or more and at most 86400")
    return body


def _parse_json(raw: bytes) -> Any:
    """`json.loads(raw)`. Given bytes, json.loads finds their encoding in Python and decodes
    with 'surrogatepass', several times slower than the parse itself; for the usual body (ASCII,
    no NUL) it would find UTF-8, so that one is decoded here (hit path)."""
    if raw.isascii() and b"\x00" not in raw:
        return json.loads(raw.decode("ascii"))
    return json.loads(raw)


def _authorize(request: web.Request, route: str, services: Services) -> Tenant | None:
    """Who calls `route`, checked before the body is read: the operator's token (--api-token)
    may do anything (None); under --tenants a tenant's token or the router's (returned, for
    `_in_scope` once the id is known). Without --tenants, /stage is open and the rest needs
    the operator's token when one is set."""
    operator, tenants = services.settings.api_token, services.tenants
    given = _bearer(request)
    if operator is not None and given is not None and hmac.compare_digest(
            given.encode(), operator.encode()):
        return None
    if not tenants.on:
        if route == "stage" or operator is None:
            return None
        raise Unauthorized("this endpoint needs 'Authorization: Bearer <token>' "
                           "(the sidecar's --api-token)")
    caller = tenants.caller(given)
    if caller is None:
        if route == "stage" and given is None and not tenants.stage_requires_token:
            return None
        raise Unauthorized("this endpoint needs 'Authorization: Bearer <token>': the "
                           "operator's (--api-token), a tenant's or the router's (--tenants)"
                           + ("; the token given is none of them" if given is not None else ""))
    if caller is ROUTER and route != "stage":
        _refuse(services, route, None, f"the router's token may only stage adapters, not {route}")
    if caller is not ROUTER and route == "compact":
        _refuse(services, route, None, f"tenant {caller.name}'s token may not compact the "
                "catalog: only the operator's may")
    return caller


def _in_scope(request: web.Request, caller: Tenant | None, route: str, adapter_id: str) -> None:
    """A tenant's token acts only on ids that start with its prefix (403 naming it)."""
    if caller is None or caller is ROUTER or caller.owns(adapter_id):
        return
    _refuse(_services(request), route, adapter_id,
            f"tenant {caller.name}'s token may {route} only adapter ids starting with "
            f"{caller.prefix!r}; {adapter_id!r} does not")


def _refuse(services: Services, route: str, adapter_id: str | None, why: str) -> NoReturn:
    services.metrics.tenant_refusals.labels(route=route).inc()
    raise Forbidden(why, adapter_id=adapter_id)


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization")
    if header is None:
        return None
    scheme, _, given = header.partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""


def _services(request: web.Request) -> Services:
    return request.app[SERVICES]


def _stage_timeout(services: Services, body: Mapping[str, Any]) -> float:
    return float(body.get("timeout_s") or services.settings.stage_timeout_s)


async def _recovered(services: Services, timeout_s: float = RECOVERY_WAIT_S) -> None:
    """Hold a call that needs the index until the start-up recovery has rebuilt it: a restart
    delays requests in flight instead of failing them (or serving a half-read cache)."""
    recovered = services.recovered
    if recovered is None or recovered.is_set():
        return
    try:
        async with asyncio.timeout(timeout_s):
            await recovered.wait()
    except TimeoutError:
        progress = "; ".join(services.readiness.problems()[:1])
        raise NotReady(f"the sidecar is still recovering its cache after a start ({progress}); "
                       "retry shortly") from None


# ---- views -------------------------------------------------------------------------------


def adapter_view(services: Services, adapter: CachedAdapter) -> dict[str, Any]:
    store = services.store
    replaced = services.catalog.replaced(adapter.adapter_id) if services.catalog else None
    return {
        "adapter_id": adapter.adapter_id,
        "path": str(services.settings.triton_root / "adapters" / adapter.adapter_id),
        "local_path": str(store.path_of(adapter.adapter_id)),
        "size_bytes": adapter.size_bytes,
        "staged_at": iso_utc(adapter.record.staged_at),
        "last_used": iso_utc(adapter.last_used),
        "pinned": store.is_pinned(adapter.adapter_id),
        "leases": store.lease_count(adapter.adapter_id),
        "standing": store.standing(adapter.adapter_id),  # its turn under --eviction-policy
        "source": adapter.record.source,
        "content_digest": adapter.record.content_digest,
        "signature": (None if adapter.record.signature is None
                      else adapter.record.signature.to_json()),
        # Set when this id was staged before with other bytes (the registry changed under it).
        "registry_changed": replaced,
        "files": {name: f.size_bytes for name, f in sorted(adapter.record.files.items())},
    }


def _stage_json(services: Services, named: Named) -> str:
    """The /stage answer: the fields that do not change are encoded once per published
    adapter, only the lease each time (hit path)."""
    result, lora_name = named.staged, named.lora_name
    adapter = result.adapter
    cached = services.stage_fragments.get(adapter.adapter_id)
    if cached is None or cached[0] is not adapter:  # a restaged adapter is a new object
        fragment = json.dumps({
            "adapter_id": adapter.adapter_id,
            "path": services.triton_adapters_prefix + adapter.adapter_id,
            "local_path": services.local_adapters_prefix + adapter.adapter_id,
            "size_bytes": adapter.size_bytes,
            "content_digest": adapter.record.content_digest,
            # Who vouched for those bytes, when the signing policy verified a signature.
            "signer": adapter.record.signer,
            "signer_identity": (adapter.record.signature.identity
                                if adapter.record.signature is not None else None),
        })[:-1]
        cached = _keep(services.stage_fragments, adapter.adapter_id, (adapter, fragment),
                       STAGE_FRAGMENTS_MAX)
    lease = result.lease
    if lease is None:
        lease_fields = '"lease_id": null, "lease_expires_at": null'
    else:  # a hex id and a timestamp: nothing in them needs escaping
        lease_fields = (f'"lease_id": "{lease.lease_id}", '
                        f'"lease_expires_at": "{iso_utc(lease.expires_at_unix)}"')
    # An adapter id or a spare name: neither needs escaping.
    return (f'{cached[1]}, "lora_name": "{lora_name}", '
            f'"cached": {"true" if result.cached else "false"}, {lease_fields}}}')


# ---- handlers ----------------------------------------------------------------------------


async def stage(request: web.Request) -> web.Response:
    services = _services(request)
    caller = _authorize(request, "stage", services)
    body = _body_at_hand(request, services, "stage")
    if body is None:  # still arriving; its head was judged
        body = _checked_body(services, await _read_body(request), "stage")
    adapter_id = check_adapter_id(body["adapter_id"])
    _in_scope(request, caller, "stage", adapter_id)
    timeout_s = _stage_timeout(services, body)
    if services.recovered is not None and not services.recovered.is_set():
        await _recovered(services, timeout_s)
    refused = body.get("engine_refused")
    lease = body.get("lease", True)
    # A hit is answered in this step, without a coroutine (hit path); the rest waits in stage.
    named = None if refused is not None else services.naming.hit(adapter_id, lease=lease)
    if named is None:
        named = await services.naming.stage(
            adapter_id, timeout_s=timeout_s, lease=lease, hold_s=float(body.get("hold_s", 0.0)),
            refused=None if refused is None else EngineRefusal.from_json(refused))
    return web.Response(body=_stage_json(services, named).encode(), headers=JSON_HEADERS)


async def release(request: web.Request) -> web.Response:
    services = _services(request)
    body = await _body(request, services, "release")
    await _recovered(services)
    lease = services.store.release(body["lease_id"])
    return web.json_response({"released": True, "adapter_id": lease.adapter_id})


async def evict(request: web.Request) -> web.Response:
    services = _services(request)
    caller = _authorize(request, "evict", services)
    body = await _body(request, services, "evict")
    adapter_id = check_adapter_id(body["adapter_id"])
    _in_scope(request, caller, "evict", adapter_id)
    await _recovered(services)
    store = services.store
    if store.get(adapter_id) is None:
        # Not on disk; a remembered refusal is what the operator means to clear (fixed in
        # place in the registry): the next stage fetches and judges it afresh.
        if services.stager.forget(adapter_id):
            return web.json_response({
                "adapter_id": adapter_id, "freed_bytes": 0, "reason": "forgotten",
                "broken_leases": [], "forgot_refusal": True,
            })
    eviction = store.evict(adapter_id, force=body.get("force", False))
    forgot = services.stager.forget(adapter_id)
    return web.json_response({
        "adapter_id": adapter_id,
        "freed_bytes": eviction.freed_bytes,
        "reason": eviction.reason.value,
        "broken_leases": eviction.broken_leases,
        "forgot_refusal": forgot,
    })


async def pin(request: web.Request) -> web.Response:
    services = _services(request)
    caller = _authorize(request, "pin", services)
    body = await _body(request, services, "pin")
    adapter_id = check_adapter_id(body["adapter_id"])
    _in_scope(request, caller, "pin", adapter_id)
    await _recovered(services, _stage_timeout(services, body))
    result = await services.stager.pin(adapter_id, timeout_s=_stage_timeout(services, body))
    return web.json_response(adapter_view(services, result.adapter))


async def unpin(request: web.Request) -> web.Response:
    services = _services(request)
    caller = _authorize(request, "unpin", services)
    body = await _body(request, services, "unpin")
    adapter_id = check_adapter_id(body["adapter_id"])
    _in_scope(request, caller, "unpin", adapter_id)
    await _recovered(services)
    was_pinned = services.store.unpin(adapter_id)
    if was_pinned:
        log.info("unpinned adapter_id=%s", adapter_id)
    return web.json_response({"adapter_id": adapter_id, "was_pinned": was_pinned})


async def list_adapters(request: web.Request) -> web.Response:
    services = _services(request)
    await _recovered(services)
    snap = services.store.snapshot()
    return web.json_response({
        "adapters": [adapter_view(services, a) for a in services.store.adapters()],
        "cache": {
            "bytes": snap.cache_bytes,
            "adapters": snap.cache_adapters,
            "max_bytes": snap.capacity_bytes,
            "max_adapters": snap.capacity_adapters,
            "pinned": snap.pinned_adapters,
            "active_leases": snap.active_leases,
        },
        "staging": services.stager.inflight,
    })


async def get_adapter(request: web.Request) -> web.Response:
    services = _services(request)
    adapter_id = check_adapter_id(request.match_info["adapter_id"])
    await _recovered(services)
    adapter = services.store.get(adapter_id)
    if adapter is None:
        raise NotCached(f"adapter {adapter_id} is not in the cache", adapter_id=adapter_id)
    return web.json_response(adapter_view(services, adapter))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    readiness = _services(request).readiness
    problems, notices = readiness.problems(), readiness.notices()
    if problems:
        body = NotReady("; ".join(problems)).to_json()
        body.update(ready=False, problems=problems, notices=notices)
        return web.json_response(body, status=status_of(NotReady("")))
    # A full cache volume is named here but keeps the node ready: hits still serve.
    return web.json_response({"ready": True, "notices": notices})


async def metrics(request: web.Request) -> web.StreamResponse:
    return await _services(request).metrics_handler(request)


async def metrics_epp(request: web.Request) -> web.Response:
    exporter = _services(request).epp
    if exporter is None:
        return _error(NoSuchEndpoint("/metrics/epp is off; start the sidecar with "
                                     "--epp-metrics true"))
    return web.Response(body=exporter.render(), headers={"Content-Type": CONTENT_TYPE})


async def catalog(request: web.Request) -> web.Response:
    services = _services(request)
    body: dict[str, Any] = ({"enabled": False} if services.catalog is None
                            else services.catalog.status())
    if services.registry_listing is not None:
        body["registry"] = services.registry_listing.status()
    return web.json_response(body)


async def compact(request: web.Request) -> web.Response:
    services = _services(request)
    _authorize(request, "compact", services)
    if request.content_length:
        await _body(request, services, "compact")
    if services.catalog is None:
        raise CatalogDisabled("this sidecar renders no catalog: there is nothing to compact")
    return web.json_response(services.catalog.request_compaction(), status=202)


# ---- errors ------------------------------------------------------------------------------


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_errors(handler: Handler) -> Handler:
    """Every error as JSON with its status from STATUS; a wrapper per route, not a
    middleware (hit path)."""

    @functools.wraps(handler)
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except SidecarError as exc:
            status = status_of(exc)
            if status >= 500 and not exc.logged:
                log.warning("%s %s -> %d %s: %s", request.method, request.path, status,
                            exc.code, exc.message)
            return _error(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.reason
            if exc.status == 413:
                limit = request.app[SERVICES].settings.max_request_bytes
                message = f"the request body is larger than {limit} bytes"
            return _error(_HTTP_ERRORS.get(exc.status, SidecarError)(message), exc.status)
        except Exception:
            log.exception("unexpected error in %s %s", request.method, request.path)
            return _error(SidecarError("unexpected error; see the sidecar's log"))

    return handle


def _error(error: SidecarError, status: int | None = None) -> web.Response:
    return web.json_response(error.to_json(), status=status or status_of(error))


async def _not_found(request: web.Request) -> web.Response:
    return _error(NoSuchEndpoint(f"no such endpoint: {request.path[:200]}"))


def _method_not_allowed(allowed: str) -> Handler:
    async def refuse(request: web.Request) -> web.Response:
        response = _error(MethodNotAllowed(
            f"{request.method[:20]} is not allowed here; use {allowed}"))
        response.headers["Allow"] = allowed
        return response

    return refuse


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("POST", "/stage", stage),
    ("POST", "/release", release),
    ("POST", "/evict", evict),
    ("POST", "/pin", pin),
    ("POST", "/unpin", unpin),
    ("GET", "/adapters", list_adapters),
    ("GET", "/adapters/{adapter_id}", get_adapter),
    ("GET", "/healthz", healthz),
    ("GET", "/readyz", readyz),
    ("GET", "/metrics", metrics),
    ("GET", "/metrics/epp", metrics_epp),
    ("GET", "/catalog", catalog),
    ("POST", "/catalog/compact", compact),
)
# What the --metrics-host listener serves: read-only, nothing about a tenant's adapter.
READ_ONLY_ROUTES: tuple[tuple[str, str, Handler], ...] = tuple(
    route for route in ROUTES if route[1] in ("/healthz", "/readyz", "/metrics", "/metrics/epp"))


def build_web_app(services: Services,
                  routes: tuple[tuple[str, str, Handler], ...] = ROUTES) -> web.Application:
    app = web.Application(client_max_size=services.settings.max_request_bytes)
    app[SERVICES] = services
    for method, path, handler in routes:
        app.router.add_route(method, path, json_errors(handler))
        # Registered after the real method, so it only answers the others (HEAD comes with GET).
        app.router.add_route("*", path, _method_not_allowed(method))
    # `[\s\S]`, not `.`: a path may decode to control characters such as a newline.
    app.router.add_route("*", r"/{tail:[\s\S]*}", _not_found)
    return app
