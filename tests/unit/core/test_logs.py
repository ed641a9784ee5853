"""Logs: with `--log-format json` every line is one JSON object; each state change is one line
carrying its adapter id, bytes, duration and outcome; no credential is ever written."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.config import Settings
from sidecar.core.logs import JsonFormatter, LogFormat, fields
from tests.support.api import StartSidecar, call
from tests.support.broken_adapters import CORPUS
from tests.support.processes import SidecarProcess
from tests.support.s3 import S3Registry
from tests.support.settings import local_registry_adapter, make_settings
from tests.support.waiting import eventually

AWS_SECRET = "aws-secret-Zq7Xw2Lk9Pd4Vn8Rt3Hs6"
API_TOKEN = "api-token-Mb5Cj1Fy8Ge2Ku7Wq4"
TRUNCATED = next(case for case in CORPUS if case.name == "truncated_file")


def _lines(text: str) -> list[dict[str, Any]]:
    complete = text[: text.rfind("\n") + 1]  # a line being written is read next time
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def _events(lines: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("event") == event]


async def test_json_log_lines_carry_each_state_change_and_no_credential(
    tmp_path: Path, s3: S3Registry, sidecar_processes: list[SidecarProcess],
    http: aiohttp.ClientSession,
) -> None:
    files = s3.put_adapter("a", seed=1)
    s3.put_adapter("b", seed=2)
    TRUNCATED.write(tmp_path / "broken")
    s3.put_folder("broken", tmp_path / "broken")
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": AWS_SECRET}
    process = SidecarProcess(
        ["--registry", s3.registry, "--s3-endpoint-url", s3.endpoint_url,
         "--cache-root", str(tmp_path / "cache"), "--min-free-disk", "0",
         "--api-token", API_TOKEN, "--lease-ttl", "0.5",
         "--log-format", "json", "--log-level", "DEBUG"],
        tmp_path / "sidecar.log", env=env,
    )
    sidecar_processes.append(process)
    url = process.url
    auth = {"Authorization": f"Bearer {API_TOKEN}"}

    for _ in range(2):  # a miss, then a hit
        status, _ = await call(http, "POST", f"{url}/stage", {"adapter_id": "a", "lease": False})
        assert status == 200
    status, _ = await call(http, "POST", f"{url}/evict", {"adapter_id": "a"},
                           headers={"Authorization": "Bearer wrong-token"})
    assert status == 401
    status, _ = await call(http, "POST", f"{url}/evict", {"adapter_id": "a"}, headers=auth)
    assert status == 200
    status, _ = await call(http, "POST", f"{url}/stage", {"adapter_id": "broken"})
    assert status == 422
    status, _ = await call(http, "POST", f"{url}/stage", {"adapter_id": "b"})  # leased ...
    assert status == 200

    async def lease_expired() -> list[dict[str, Any]]:  # ... until its 0.5 s run out
        return _events(_lines(process.log_text()), "lease_expired")

    await eventually(lease_expired, timeout_s=5, what="the lease expiry is logged")
    process.stop()  # the shutdown lines are JSON too
    text = process.log_path.read_text()
    lines = _lines(text)

    assert all({"ts", "level", "logger", "message"} <= line.keys() for line in lines)
    size_bytes = sum(len(b) for b in files.values())
    staged = [line for line in _events(lines, "staged") if line["adapter_id"] == "a"]
    assert len(staged) == 1
    assert staged[0]["level"] == "info"
    assert staged[0]["size_bytes"] == size_bytes
    assert staged[0]["duration_s"] >= 0
    assert f"bytes={size_bytes}" in staged[0]["message"]
    (hit,) = _events(lines, "hit")
    assert (hit["level"], hit["adapter_id"], hit["size_bytes"]) == ("debug", "a", size_bytes)
    (evicted,) = _events(lines, "evicted")
    assert evicted["adapter_id"] == "a"
    assert evicted["size_bytes"] == size_bytes
    assert evicted["reason"] == "manual"
    assert evicted["age_s"] >= 0
    (refused,) = _events(lines, "refused")
    assert refused["level"] == "warning"
    assert refused["problems"] == ["safetensors_length_mismatch"]
    (expired,) = _events(lines, "lease_expired")
    assert expired["adapter_id"] == "b"
    # The settings line is short, its values are fields of their own, it says a token is
    # set, and nothing shows it or the AWS secret.
    (settings,) = _events(lines, "settings")
    assert settings["settings"]["api_token"] == "<set>"
    assert settings["settings"]["lease_ttl_s"] == 0.5
    assert "api_token=<set>" in settings["message"] and "lease_ttl_s=0.5" in settings["message"]
    assert "{" not in settings["message"] and len(settings["message"]) < 400
    assert AWS_SECRET not in text
    assert API_TOKEN not in text
    assert "wrong-token" not in text


async def test_a_failed_stage_is_one_warning_however_many_callers_wait_for_it(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    local_registry_adapter(tmp_path, "big-v1")
    sidecar = await start_sidecar(make_settings(tmp_path, max_bytes=1024))
    caplog.set_level(logging.INFO)

    answers = await asyncio.gather(*(
        call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "big-v1"}) for _ in range(3)))

    assert [(status, body["error"]) for status, body in answers] == [(507, "cache_full")] * 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("stage failed adapter_id=big-v1")


def test_text_is_the_default_and_settings_hide_a_password_in_a_url() -> None:
    settings = Settings.from_values({
        "registry": "s3://adapters/lora",
        "s3_endpoint_url": "http://minio:minio-password@127.0.0.1:9000",
        "api_token": API_TOKEN,
    })
    assert settings.log_format is LogFormat.TEXT
    shown = json.dumps(settings.describe())
    assert "minio-password" not in shown and API_TOKEN not in shown
    assert "http://minio:<hidden>@127.0.0.1:9000" in shown


def test_the_settings_line_names_only_what_differs_from_the_defaults() -> None:
    settings = Settings.from_values({
        "registry": "s3://adapters/lora", "pin": "a,b", "compaction_window": "02:00-04:00",
        "s3_endpoint_url": "http://minio:minio-password@127.0.0.1:9000", "api_token": API_TOKEN,
    })

    line = settings.changes()

    assert line == ('registry=s3://adapters/lora s3_endpoint_url=http://minio:<hidden>@127.0.0.1'
                    ':9000 pin=a,b compaction_window="02:00-04:00 UTC" api_token=<set>')
    assert Settings.from_values({}).changes() == "all at their defaults"


def test_json_lines_put_the_fields_of_a_state_change_beside_the_message() -> None:
    record = logging.LogRecord("sidecar.stager", logging.INFO, __file__, 1,
                               "staged adapter_id=%s", ("a",), None)
    for key, value in fields(event="staged", adapter_id="a", size_bytes=10,
                             duration_s=0.25, message="must not replace the message").items():
        setattr(record, key, value)
    record.created = time.time()

    line = json.loads(JsonFormatter().format(record))

    assert line["message"] == "staged adapter_id=a"
    assert line["level"] == "info"
    assert (line["adapter_id"], line["size_bytes"], line["duration_s"]) == ("a", 10, 0.25)


def test_malformed_requests_are_logged_as_one_debug_line_without_a_traceback() -> None:
    from aiohttp.http_exceptions import LineTooLong

    from sidecar.web.server import _QuietBadRequests

    try:
        raise LineTooLong("header line", "8190", "20000")
    except LineTooLong:
        record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1,
                                   "Error handling request", None, sys.exc_info())
    assert _QuietBadRequests().filter(record) is True
    assert record.levelno == logging.DEBUG
    assert record.exc_info is None
    assert "malformed request" in record.getMessage()
