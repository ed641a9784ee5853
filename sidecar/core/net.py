"""Addresses and URLs: what is this machine's own (loopback), and a URL fit to be shown."""

from __future__ import annotations

import ipaddress
import re

_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]*@")


def hide_password(text: str) -> str:
    """A URL fit for logs and error messages: `http://user:<hidden>@host`."""
    return _URL_PASSWORD.sub(r"\1<hidden>@", text)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
