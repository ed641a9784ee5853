"""Which HTTP proxy a registry URL goes through: the usual variables (http_proxy, https_proxy,
all_proxy, in either case), with no_proxy honoured, and never one for a loopback address.

Corporate containers often set http_proxy with no no_proxy; a proxy cannot reach this node's
own loopback, and a registry on 127.0.0.1 is the node's own.
"""

from __future__ import annotations

import urllib.parse
import urllib.request

from ..core.net import is_loopback


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1, localhost and its sub-domains (RFC 6761)."""
    host = host.strip("[]").lower().rstrip(".")
    return is_loopback(host) or host.endswith(".localhost")


def proxy_for(url: str) -> str | None:
    """The proxy URL for `url`, or None to connect directly."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if not host or is_loopback_host(host):
        return None
    proxies = urllib.request.getproxies_environment()
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    if urllib.request.proxy_bypass(netloc):  # no_proxy, as botocore reads it too
        return None
    return proxies.get(parts.scheme) or proxies.get("all") or None


def botocore_proxies(endpoint_url: str | None) -> dict[str, str] | None:
    """botocore's `proxies` setting for a client of this endpoint, decided as for the ranged
    GETs ({} is no proxy at all); None (AWS's own endpoints) lets botocore read the same
    variables itself."""
    if endpoint_url is None:
        return None
    proxy = proxy_for(endpoint_url)
    return {} if proxy is None else {urllib.parse.urlsplit(endpoint_url).scheme: proxy}
