"""Who may act on which adapters (`--tenants FILE`, TOML): a bearer token per adapter-id prefix
(a tenant stages, pins, unpins and evicts only ids that start with its prefix), the router's
token (stages every id), and whether /stage needs a token at all. The operator's token
(--api-token) may do everything. Read once at start; without a file nothing here applies.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.fsutil import read_toml

TENANTS_MAX_BYTES = 64 * 1024
# Ids have no folders ('/' is not allowed, core/ids.py): a prefix is the start of the id, and
# must end in a separator, so that `tenant-a-` never covers `tenant-ab-…`.
_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,126}[._-]$")
TOKEN_MIN_CHARACTERS = 16


def _digest(token: str) -> bytes:
    """Tokens are looked up as SHA-256 digests: the same length, whatever theirs."""
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    prefix: str
    token_sha256: bytes

    def owns(self, adapter_id: str) -> bool:
        return adapter_id.startswith(self.prefix)


ROUTER = Tenant("router", "", b"")  # the router's token: stages every id, nothing else


@dataclass(frozen=True, slots=True)
class Tenants:
    tenants: tuple[Tenant, ...] = ()
    router_token_sha256: bytes | None = None
    stage_requires_token: bool = False
    path: Path | None = None  # None: no --tenants file, everything here is off
    # The callers by their token's digest (each token is unique: `_token`).
    _by_digest: dict[bytes, Tenant] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_digest = {tenant.token_sha256: tenant for tenant in self.tenants}
        if self.router_token_sha256 is not None:
            by_digest[self.router_token_sha256] = ROUTER
        object.__setattr__(self, "_by_digest", by_digest)

    @property
    def on(self) -> bool:
        return self.path is not None

    def caller(self, token: str | None) -> Tenant | None:
        """The tenant (or ROUTER) a bearer token belongs to; None for no or an unknown token.

        Looked up by the token's SHA-256 digest: comparing the digest with every entry cost
        each request time in proportion to the tenants (24 µs at 600; a 64 KiB tenants file
        holds about 900), on the hit path. The lookup's time does not depend on how much of a
        guess matches a stored token: bytes are compared only where the digests' hashes meet,
        and no one can steer a guess's digest toward a stored one."""
        if token is None:
            return None
        return self._by_digest.get(_digest(token))

    @classmethod
    def load(cls, path: Path) -> Tenants:
        """Read and check a tenants file; ValueError lists every problem found."""
        data = read_toml(path, TENANTS_MAX_BYTES)
        problems: list[str] = []
        tenants = _parse(data, problems)
        if problems:
            raise ValueError("; ".join(problems))
        return tenants._with_path(path)

    def _with_path(self, path: Path) -> Tenants:
        return Tenants(self.tenants, self.router_token_sha256, self.stage_requires_token, path)


NO_TENANTS = Tenants()


def _parse(data: Mapping[str, Any], problems: list[str]) -> Tenants:
    unknown = sorted(set(data) - {"stage_requires_token", "router", "tenants"})
    problems.extend(f"unknown key {key!r}" for key in unknown)
    requires = data.get("stage_requires_token", False)
    if not isinstance(requires, bool):
        problems.append("stage_requires_token must be true or false")
        requires = False
    router = data.get("router")
    router_digest = None
    seen_tokens: set[bytes] = set()
    if router is not None:
        if not isinstance(router, dict) or set(router) != {"token"}:
            problems.append("[router] takes one key: token")
        else:
            router_digest = _token(router["token"], "[router]", problems, seen_tokens)
    tenants: list[Tenant] = []
    entries = data.get("tenants", [])
    if not isinstance(entries, list):
        problems.append("tenants must be an array of tables ([[tenants]])")
        entries = []
    names: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"[[tenants]] #{i + 1}"
        if not isinstance(entry, dict) or set(entry) != {"name", "prefix", "token"}:
            problems.append(f"{where} takes three keys: name, prefix, token")
            continue
        name, prefix = entry["name"], entry["prefix"]
        if not isinstance(name, str) or not name or name in names:
            problems.append(f"{where}: name must be a string, unique among the tenants")
            continue
        names.add(name)
        if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
            problems.append(f"{where} ({name}): prefix {str(prefix)[:80]!r} must be the start "
                            "of an adapter id (letters, digits, '.', '_', '-'; no '/': ids "
                            "have none) ending in '-', '_' or '.'")
            continue
        digest = _token(entry["token"], where, problems, seen_tokens)
        if digest is not None:
            tenants.append(Tenant(name, prefix, digest))
    return Tenants(tuple(tenants), router_digest, requires)


def _token(token: object, where: str, problems: list[str], seen: set[bytes]) -> bytes | None:
    if not isinstance(token, str) or len(token.strip()) < TOKEN_MIN_CHARACTERS:
        problems.append(f"{where}: token must be a string of at least {TOKEN_MIN_CHARACTERS} "
                        "characters")
        return None
    digest = _digest(token.strip())
    if digest in seen:
        problems.append(f"{where}: token is used twice; each tenant needs its own")
        return None
    seen.add(digest)
    return digest
