"""The S3 registry kind: `s3://bucket/prefix`, its own options (contributed to the option table
through kinds.py) and how a registry of this kind is opened. Light on purpose: parsing the
settings reads this module, and aiobotocore is imported only when a registry opens
(s3_client.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from ..core.options import (
    at_least,
    option,
    parse_float,
    parse_http_url,
    parse_int,
    parse_optional_str,
    positive,
)
from .base import AdapterRegistry
from .transfer import TransferPolicy

LOCATION = "s3://bucket/prefix"


@dataclasses.dataclass(frozen=True)
class S3Options:
    s3_endpoint_url: str | None = option(
        "--s3-endpoint-url", parse_http_url, "", "S3-compatible endpoint, e.g. http://minio:9000",
        "URL", default_text="AWS S3")
    s3_region: str | None = option(
        "--s3-region", parse_optional_str, "", "S3 region", "REGION",
        default_text="the AWS credential chain's region, else us-east-1")
    s3_connect_timeout_s: float = option(
        "--s3-connect-timeout", positive(parse_float), "5",
        "seconds to wait for a connection to the registry", "SECONDS")
    s3_read_timeout_s: float = option(
        "--s3-read-timeout", positive(parse_float), "30",
        "seconds to wait for the registry's next bytes before giving up on a request", "SECONDS")
    s3_max_attempts: int = option(
        "--s3-max-attempts", at_least(parse_int, 1, "at least 1"), "5",
        "attempts per registry request (with capped exponential backoff and jitter)", "N")


def check_location(location: str) -> None:
    """Raise ValueError if `location` cannot name an S3 registry."""
    bucket = location.removeprefix("s3://").split("/", 1)[0]
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise ValueError(f"{bucket!r} is not a valid S3 bucket name")


def open_registry(location: str, options: S3Options, policy: TransferPolicy,
                  on_error: Callable[[str], None],
                  on_skipped: Callable[[int], None]) -> AdapterRegistry:
    from .s3_client import S3Client, S3Registry  # aiobotocore: only once a registry opens

    client = S3Client(options.s3_endpoint_url, options.s3_region, options.s3_connect_timeout_s,
                      options.s3_read_timeout_s, options.s3_max_attempts)
    # Each part of a download gets the attempts of any other S3 request.
    policy = dataclasses.replace(policy, attempts=options.s3_max_attempts)
    return S3Registry(location, client, policy, on_error, on_skipped)
