"""A locked-down API: the bearer token on mutating endpoints, bounded and strict requests, ids
checked everywhere, no path outside the cache root, secrets never shown, and a fuzzed API
that always answers with its JSON errors."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import logging
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sidecar.__main__ import build_parser, settings_from
from sidecar.config import Settings
from sidecar.core.errors import ConfigError
from sidecar.process.app import Sidecar
from sidecar.process.examples import write_adapter
from sidecar.web import api
from tests.support.api import StartSidecar, call
from tests.support.processes import SidecarProcess, free_port
from tests.support.s3 import S3Registry, set_moto_auth
from tests.support.settings import local_registry_adapter, make_settings, s3_settings
from tests.support.waiting import eventually

TOKEN = "tok-" + secrets.token_hex(16)
BEARER = {"Authorization": f"Bearer {TOKEN}"}
MUTATING = ("/evict", "/pin", "/unpin")


async def start_locked(start_sidecar: StartSidecar, tmp_path: Path, **overrides: Any) -> Sidecar:
    return await start_sidecar(make_settings(tmp_path, api_token=TOKEN, **overrides))


async def catalog_ids(http: aiohttp.ClientSession, sidecar: Sidecar) -> list[str]:
    """The adapters multi_lora.json lists by their own names, after a compaction: every adapter
    on disk (the spare names beside them are never an adapter id)."""
    sidecar.reloads.request_compaction()
    await sidecar.reloads.sync()
    _, body = await call(http, "GET", f"{sidecar.url}/catalog")
    listed = json.loads((sidecar.settings.cache_root / "multi_lora.json").read_text())
    own = sorted(name for name in listed if not name.startswith("_spare-"))
    assert own == body["adapter_ids"], body
    assert len(listed) - len(own) == body["spares"]["total"]
    return list(body["adapter_ids"])


def files_outside(root: Path, *inside: Path) -> dict[str, int]:
    """Every file under `root` but outside the given folders: path -> size."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file() and not any(path.is_relative_to(folder) for folder in inside):
            found[str(path)] = path.stat().st_size
    return found


# ---- the bearer token -------------------------------------------------------------------------


@pytest.mark.parametrize("authorization", [
    None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}",
    "Bearer ", TOKEN, f"Bearer  {TOKEN} extra",
], ids=["none", "wrong", "basic", "longer", "shorter", "empty", "no_scheme", "extra_words"])
@pytest.mark.parametrize("path", MUTATING)
async def test_mutating_endpoints_refuse_a_missing_or_wrong_token(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession, path: str,
    authorization: str | None,
) -> None:
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_locked(start_sidecar, tmp_path)
    headers = {"Authorization": authorization} if authorization is not None else {}

    status, body = await call(http, "POST", f"{sidecar.url}{path}", {"adapter_id": "a"},
                              headers=headers)

    assert status == 401, body
    assert body["error"] == "unauthorized"
    assert TOKEN not in json.dumps(body)
    assert sidecar.store.get("a") is None and not sidecar.store.is_pinned("a")


async def test_the_token_opens_mutating_endpoints_while_stage_and_release_stay_open(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_locked(start_sidecar, tmp_path)
    url = sidecar.url

    answers = await asyncio.gather(*(call(http, "POST", f"{url}/stage", {"adapter_id": "a"})
                                     for _ in range(20)))
    assert {status for status, _ in answers} == {200}
    lease_ids = [body["lease_id"] for _, body in answers]
    # A lease id is the only capability /release needs: 128 random bits, never repeated.
    assert all(re.fullmatch(r"[0-9a-f]{32}", lease_id) for lease_id in lease_ids)
    assert len(set(lease_ids)) == len(lease_ids)
    for lease_id in lease_ids:
        status, body = await call(http, "POST", f"{url}/release", {"lease_id": lease_id})
        assert status == 200, body

    assert (await call(http, "POST", f"{url}/pin", {"adapter_id": "a"}, BEARER))[0] == 200
    assert (await call(http, "POST", f"{url}/unpin", {"adapter_id": "a"}, BEARER))[0] == 200
    status, body = await call(http, "POST", f"{url}/evict", {"adapter_id": "a"},
                              {"Authorization": f"bearer {TOKEN}"})  # the scheme is caseless
    assert status == 200, body
    assert sidecar.store.get("a") is None


def test_the_token_comes_from_the_flag_the_environment_or_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    parser = build_parser()

    from_flag = settings_from(parser.parse_args(["serve", "--api-token", TOKEN]), {})
    from_env = settings_from(parser.parse_args(["serve"]), {"LORA_SIDECAR_API_TOKEN": TOKEN})
    from_file = settings_from(parser.parse_args(["serve", "--api-token-file", str(token_file)]),
                              {})
    flag_wins = settings_from(parser.parse_args(["serve", "--api-token", TOKEN]),
                              {"LORA_SIDECAR_API_TOKEN": "from-env"})

    for found in (from_flag, from_env, from_file, flag_wins):
        assert found.api_token == TOKEN
        assert TOKEN not in repr(found) and TOKEN not in json.dumps(found.describe())
    token_file.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        Settings.from_values({"api_token_file": str(token_file)})


async def test_the_token_never_appears_in_answers_metrics_or_logs(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG", logger="sidecar")
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_locked(start_sidecar, tmp_path)
    url = sidecar.url
    seen = []
    for path, body, headers in (
        ("/evict", {"adapter_id": "a"}, {"Authorization": f"Bearer {TOKEN}0"}),
        ("/pin", {"adapter_id": "a"}, BEARER),
        ("/evict", {"adapter_id": "a"}, BEARER),
        ("/evict", {"adapter_id": "a"}, BEARER),
        ("/stage", {"adapter_id": "missing"}, BEARER),
        ("/unpin", {"adapter_id": "../x"}, BEARER),
    ):
        seen.append(await call(http, "POST", f"{url}{path}", body, headers))
    for path in ("/metrics", "/healthz", "/readyz", "/adapters", "/catalog"):
        seen.append(await call(http, "GET", f"{url}{path}"))

    assert TOKEN not in json.dumps(seen)
    assert TOKEN not in caplog.text


async def test_the_default_bind_is_loopback(
    tmp_path: Path, start_sidecar: StartSidecar
) -> None:
    assert Settings().host == Settings.from_values({}).host == "127.0.0.1"
    sidecar = await start_sidecar(make_settings(tmp_path))
    assert sidecar._runner is not None
    assert [address[0] for address in sidecar._runner.addresses] == ["127.0.0.1"]


def test_binding_beyond_loopback_warns_without_a_token_and_the_token_stays_out_of_the_log(
    tmp_path: Path, sidecar_processes: list[SidecarProcess]
) -> None:
    (tmp_path / "registry").mkdir()
    base = ["--registry", str(tmp_path / "registry"), "--host", "0.0.0.0", "--log-level", "DEBUG"]
    open_log, locked_log = tmp_path / "open.log", tmp_path / "locked.log"
    sidecar_processes.append(SidecarProcess([*base, "--cache-root", str(tmp_path / "c1")],
                                            open_log))
    locked = SidecarProcess([*base, "--cache-root", str(tmp_path / "c2")], locked_log,
                            env={**os.environ, "LORA_SIDECAR_API_TOKEN": TOKEN})
    sidecar_processes.append(locked)

    refused = _post(locked.url, "/evict", {"adapter_id": "a"})
    allowed = _post(locked.url, "/evict", {"adapter_id": "a"}, BEARER)
    for process in sidecar_processes:
        process.stop()

    assert refused[0] == 401
    assert (allowed[0], allowed[1]["error"]) == (404, "not_cached")
    assert "without --api-token" in open_log.read_text()
    log_text = locked_log.read_text()
    assert "without --api-token" not in log_text
    assert "api_token=<set>" in log_text  # the settings line shows that it is set...
    assert TOKEN not in log_text  # ...and never what it is


def _post(url: str, path: str, body: Any, headers: dict[str, str] | None = None,
          ) -> tuple[int, Any]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", path, json.dumps(body).encode(),
                           {"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


# ---- bounded, strict requests -----------------------------------------------------------------


async def test_a_body_over_the_cap_is_413_json_and_the_sidecar_keeps_serving(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_locked(start_sidecar, tmp_path, max_request_bytes=4096)
    huge = {"adapter_id": "a" * 5000}
    for path in ("/stage", "/release", *MUTATING):
        status, body = await call(http, "POST", f"{sidecar.url}{path}", huge, BEARER)
        assert status == 413, (path, body)
        assert body["error"] == "request_too_large"
        assert "4096" in body["message"]
    assert (await call(http, "GET", f"{sidecar.url}/healthz"))[0] == 200


async def raw_request(port: int, head: bytes) -> bytes:
    """Send a raw request head; return the status line (or b"" if the server hung up)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()
        await writer.wait_closed()


@pytest.mark.parametrize("head", [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-H%d: v\r\n" % i for i in range(200)) + b"\r\n",
    b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["huge_header", "many_headers", "huge_request_line"])
async def test_huge_or_too_many_headers_are_refused_with_4xx(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession, head: bytes
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))

    status_line = await raw_request(sidecar.port, head)

    assert re.match(rb"HTTP/1\.[01] 4\d\d ", status_line), status_line
    assert (await call(http, "GET", f"{sidecar.url}/healthz"))[0] == 200


async def raw_answer(port: int, head: bytes, body_part: bytes = b"",
                     later: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Send a request head and only part of its body (and, `later`, the rest after a pause
    in which the handler waits for it); return the answer's status and JSON."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body_part)
        await writer.drain()
        if later:
            await asyncio.sleep(0.3)  # the point: the handler has the head and waits for the rest
            writer.write(later)
            await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        length = 0
        while (line := await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = await asyncio.wait_for(reader.readexactly(length), 10)
        return int(status_line.split()[1]), json.loads(payload)
    finally:
        writer.close()
        await writer.wait_closed()


def _stage_head(content_length: int) -> bytes:
    return (b"POST /stage HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % content_length)


async def test_a_declared_body_over_the_cap_is_413_before_any_of_it_is_read(
    tmp_path: Path, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path, max_request_bytes=4096))
    # 10 MB announced and a few bytes sent: the answer comes from the header alone.
    status, body = await raw_answer(sidecar.port, _stage_head(10_000_000), b'{"adapter_id"')
    assert status == 413, body
    assert body["error"] == "request_too_large" and "4096" in body["message"]


async def test_a_body_that_stops_arriving_is_408_json(
    tmp_path: Path, start_sidecar: StartSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api, "BODY_READ_TIMEOUT_S", 0.5)
    sidecar = await start_sidecar(make_settings(tmp_path))
    status, body = await raw_answer(sidecar.port, _stage_head(100), b'{"adapter_id": ')
    assert status == 408, body
    assert body["error"] == "request_timeout" and "0.5s" in body["message"]


async def test_a_caller_hanging_up_mid_body_is_no_error_and_the_sidecar_keeps_serving(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    reading = asyncio.Event()
    read_body = api._read_body

    async def read_body_noted(request: web.Request) -> bytes:
        reading.set()  # the handler goes on to wait for the rest before this test runs again
        return await read_body(request)

    monkeypatch.setattr(api, "_read_body", read_body_noted)
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_sidecar(make_settings(tmp_path))
    for _ in range(3):
        reading.clear()
        _, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
        writer.write(_stage_head(100) + b'{"adapter_id": ')
        await writer.drain()
        await asyncio.wait_for(reading.wait(), 10)  # the handler is now waiting for the rest
        writer.transport.abort()
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a"})
    assert status == 200, body
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("path, body", [
    ("/stage", {"adapter_id": "a", "aws_access_key_id": "AKIA"}),  # credentials never come in
    ("/stage", {"adapter_id": "a", "path": "/etc"}),
    ("/stage", {"adapter_id": ["a"]}),
    ("/stage", {"adapter_id": "a", "timeout_s": True}),
    ("/stage", {"adapter_id": "a", "timeout_s": -1}),
    ("/stage", {"adapter_id": "a", "lease": "yes"}),
    ("/stage", {}),
    ("/stage", ["a"]),
    ("/release", {"lease_id": 7}),
    ("/evict", {"adapter_id": "a", "force": 1}),
    ("/pin", {"adapter_id": "a", "force": True}),
    ("/unpin", {"adapter_id": None}),
])
async def test_unknown_fields_and_wrong_types_are_refused(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession, path: str,
    body: Any,
) -> None:
    sidecar = await start_locked(start_sidecar, tmp_path)
    status, answer = await call(http, "POST", f"{sidecar.url}{path}", body, BEARER)
    assert status == 400, answer
    assert answer["error"] == "invalid_request"


# ---- ids checked everywhere -------------------------------------------------------------------


BAD_IDS = ["../x", "a/b", "..", ".", "-dash", "a b", "x" * 129, "a\\b", "a\x00b", ""]


@pytest.mark.parametrize("adapter_id", BAD_IDS)
async def test_every_endpoint_checks_ids(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession, adapter_id: str
) -> None:
    sidecar = await start_locked(start_sidecar, tmp_path)
    for path in ("/stage", *MUTATING):
        status, body = await call(http, "POST", f"{sidecar.url}{path}",
                                  {"adapter_id": adapter_id}, BEARER)
        assert (status, body["error"]) == (400, "invalid_adapter_id"), (path, body)
    if adapter_id not in ("", ".", ".."):  # those are path segments, not ids, in a URL
        status, body = await call(http, "GET",
                                  f"{sidecar.url}/adapters/{quote(adapter_id, safe='')}")
        assert (status, body["error"]) == (400, "invalid_adapter_id"), body
    assert list((tmp_path / "cache" / "adapters").iterdir()) == []


@pytest.mark.parametrize("command", ["stage", "evict", "pin", "unpin", "prewarm"])
def test_the_cli_refuses_a_bad_id_before_calling_the_sidecar(command: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: a call would say unreachable
    result = subprocess.run([sys.executable, "-m", "sidecar", command, "../x", "--url", url],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    assert "invalid adapter id" in result.stderr and "unreachable" not in result.stderr


def test_pinned_ids_are_checked_in_the_settings() -> None:
    with pytest.raises(ConfigError, match="not valid adapter ids"):
        Settings.from_values({"pin": "good,../bad"})


async def test_registry_folders_with_invalid_ids_are_never_listed(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    s3.put_adapter("good")
    for bad in ("bad id", "-dash", "..", "x" * 129):
        s3.put_object(f"{s3.prefix}/{bad}/adapter_config.json", b"{}")
    local_registry_adapter(tmp_path, "good-local")
    for bad in ("bad id", "-dash", "x" * 129):
        (tmp_path / "registry" / bad).mkdir()

    from_s3 = await start_sidecar(s3_settings(tmp_path, s3))
    local = await start_sidecar(make_settings(tmp_path, cache_root=tmp_path / "cache2"))
    for sidecar, good in ((from_s3, "good"), (local, "good-local")):
        for adapter_id in ("bad id", "-dash", "..", "x" * 129, good):
            status, body = await call(http, "POST", f"{sidecar.url}/stage",
                                      {"adapter_id": adapter_id})
            assert status == (200 if adapter_id == good else 400), body

    assert await catalog_ids(http, from_s3) == ["good"]
    assert await catalog_ids(http, local) == ["good-local"]


async def test_the_watcher_quarantines_a_folder_copied_in_under_an_invalid_id(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))
    write_adapter(tmp_path / "cache" / "adapters" / "bad id")

    await eventually(lambda: not (tmp_path / "cache" / "adapters" / "bad id").exists(),
                     timeout_s=15, poll_s=0.05, what="the watcher moving it out of adapters/")
    assert any(p.name.startswith("bad id.") for p in (tmp_path / "cache" / ".quarantine").iterdir())
    _, listing = await call(http, "GET", f"{sidecar.url}/adapters")
    assert listing["adapters"] == []


# ---- nothing outside the cache root -----------------------------------------------------------


@pytest.mark.parametrize("name", [
    "../escape.json", "../../escape.json", "..", "/etc/passwd", "//abs.json", "a\\b.json",
    "..\\escape.json", "sub/../../escape.json", "./adapter_config.json",
])
async def test_unsafe_registry_keys_are_refused_and_nothing_is_written_outside_the_cache(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    name: str,
) -> None:
    s3.put_adapter("evil")
    s3.put_object(f"{s3.prefix}/evil/{name}", b'{"escaped": true}')
    cache = tmp_path / "cache"
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))
    before = files_outside(tmp_path, cache)

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "evil"})

    assert status == 422, body
    assert body["error"] == "invalid_adapter"
    assert {"code": "unsafe_path", "file": name} in [
        {"code": p["code"], "file": p["file"]} for p in body["problems"]]
    assert files_outside(tmp_path, cache) == before
    assert not any("escape" in str(p) or p.name == "passwd" for p in cache.rglob("*"))
    assert list((cache / "adapters").iterdir()) == [] and list((cache / ".staging").iterdir()) == []
    assert s3.proxy.gets("/evil/") == []  # refused from the listing: nothing was fetched


async def test_a_local_registry_file_linking_outside_the_registry_is_refused(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    outside = tmp_path / "outside"
    write_adapter(outside, seed=9)
    folder = local_registry_adapter(tmp_path, "linked")
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    sidecar = await start_sidecar(make_settings(tmp_path))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "linked"})

    assert status == 422, body
    assert [(p["code"], p["file"]) for p in body["problems"]] == [
        ("symlink", "adapter_model.safetensors")]
    assert "symbolic link" in body["problems"][0]["message"]
    assert list((tmp_path / "cache" / "adapters").iterdir()) == []


async def test_a_local_registry_folder_linking_outside_the_registry_is_not_followed(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    outside = tmp_path / "outside"
    write_adapter(outside, seed=9)
    (tmp_path / "registry").mkdir()
    (tmp_path / "registry" / "linked").symlink_to(outside, target_is_directory=True)
    sidecar = await start_sidecar(make_settings(tmp_path))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "linked"})

    assert status == 404, body
    assert body["error"] == "adapter_not_found"
    assert await catalog_ids(http, sidecar) == []
    assert list((tmp_path / "cache" / "adapters").iterdir()) == []


# ---- credentials ------------------------------------------------------------------------------


def test_credentials_never_reach_logs_answers_or_metrics(
    tmp_path: Path, s3: S3Registry, sidecar_processes: list[SidecarProcess]
) -> None:
    s3.put_adapter("a")
    key_id = "AKIA" + secrets.token_hex(8).upper()
    secret = secrets.token_urlsafe(30)
    session_token = secrets.token_urlsafe(40)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret,
           "AWS_SESSION_TOKEN": session_token}
    log_path = tmp_path / "sidecar.log"
    answers: list[Any] = []
    set_moto_auth(s3.moto_url, "0")  # moto now refuses these credentials
    try:
        process = SidecarProcess(
            ["--registry", s3.registry, "--s3-endpoint-url", s3.endpoint_url,
             "--cache-root", str(tmp_path / "cache"), "--log-level", "DEBUG",
             "--s3-max-attempts", "1"], log_path, env=env)
        sidecar_processes.append(process)
        answers.append(_post(process.url, "/stage", {"adapter_id": "a"}))
        answers.append(_post(process.url, "/pin", {"adapter_id": "a"}))
        for path in ("/readyz", "/metrics", "/catalog", "/healthz", "/adapters"):
            answers.append(_get_text(process.url, path))
    finally:
        set_moto_auth(s3.moto_url, "inf")
    process.stop()

    assert answers[0][0] == 502 and answers[0][1]["cause"] == "credentials", answers[0]
    shown = json.dumps(answers) + log_path.read_text()
    assert "InvalidAccessKeyId" in shown  # the refusal is reported...
    for value in (key_id, secret, session_token):  # ...without the credentials
        assert value not in shown


def _get_text(url: str, path: str) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


# ---- the fuzzed API -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fuzzed:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None


_ids = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,30}", fullmatch=True),
    st.sampled_from(["known", "..", ".", "../etc/passwd", "a/b", "x" * 129, "", "a\\b"]),
    st.text(max_size=140),
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8,
)
_fields = st.sampled_from(["adapter_id", "timeout_s", "lease", "lease_id", "force"]) | st.text(
    max_size=12)
_objects = st.dictionaries(_fields, _ids | _json, max_size=5)
_bodies = st.one_of(
    st.none(),
    _objects.map(lambda o: json.dumps(o).encode()),  # NaN and Infinity included
    _ids.map(lambda i: json.dumps({"adapter_id": i}).encode()),
    _json.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=300),
    st.integers(1000, 60000).map(lambda n: b"[" * n),  # nesting deeper than the parser's stack
    st.integers(64 * 1024 + 1, 256 * 1024).map(lambda n: b'{"adapter_id": "' + b"a" * n + b'"}'),
)
_paths = st.one_of(
    st.sampled_from(["/stage", "/release", "/evict", "/pin", "/unpin", "/adapters", "/healthz",
                     "/readyz", "/metrics", "/catalog", "/", "/stage/", "//stage", "/adapters/",
                     "/adapters/known", "/nope", "/adapters/known/x"]),
    _ids.map(lambda i: "/adapters/" + quote(i, safe="")),
    st.text(max_size=60).map(lambda t: "/" + quote(t, safe="/?=&")),
)
_header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
_authorization = st.one_of(st.just(f"Bearer {TOKEN}"), _header_text,
                           _header_text.map(lambda t: f"Bearer {t}"))
_anything = st.builds(  # any method, path, headers and body
    Fuzzed,
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    path=_paths,
    headers=st.fixed_dictionaries({}, optional={
        "Content-Type": st.sampled_from(["application/json", "application/json; charset=utf-8",
                                         "text/plain", "application/x-www-form-urlencoded",
                                         "multipart/form-data; boundary=x", ""]),
        "Authorization": _authorization,
    }),
    body=_bodies,
)
_well_formed = st.fixed_dictionaries(  # the endpoints' own fields, with odd values
    {"adapter_id": _ids},
    optional={"timeout_s": st.floats() | st.integers() | _json, "lease": st.booleans() | _json,
              "force": st.booleans() | _json, "lease_id": st.text(max_size=40) | _json},
).map(lambda o: json.dumps(o).encode())
_aimed = st.builds(  # what reaches the handlers: JSON posted to an endpoint, mostly with the token
    Fuzzed,
    method=st.just("POST"),
    path=st.sampled_from(["/stage", "/release", "/evict", "/pin", "/unpin"]),
    headers=st.fixed_dictionaries({
        "Content-Type": st.just("application/json"),
        "Authorization": st.integers(0, 3).flatmap(
            lambda n: _authorization if n == 0 else st.just(f"Bearer {TOKEN}")),
    }),
    body=st.integers(0, 2).flatmap(lambda n: _bodies if n == 0 else _well_formed),
)
_requests = st.integers(0, 4).flatmap(lambda n: _anything if n == 0 else _aimed)  # 4 aimed : 1
# Answers that are not failures even to a fuzzed request: the stage of a valid id may time out
# (a tiny timeout_s) or find the cache full of pins; /readyz may say not ready.
_SERVER_ANSWERS = {503: {"not_ready", "registry_unavailable"}, 504: {"stage_timeout"},
                   507: {"cache_full"}}


@pytest.fixture
def fuzz_target(tmp_path: Path, sidecar_processes: list[SidecarProcess]) -> Iterator[
        SidecarProcess]:
    local_registry_adapter(tmp_path, "known")
    process = SidecarProcess(["--registry", str(tmp_path / "registry"), "--cache-root",
                              str(tmp_path / "cache"), "--api-token", TOKEN, "--max-adapters",
                              "4", "--max-request-bytes", "64KiB"], tmp_path / "sidecar.log")
    sidecar_processes.append(process)
    yield process


def test_fuzzed_requests_get_json_errors_never_a_500_and_the_sidecar_keeps_serving(
    fuzz_target: SidecarProcess,
) -> None:
    counts: dict[int, int] = {}

    @settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=_requests)
    # Paths that decode to control characters once slipped past the JSON catch-all route.
    @example(request=Fuzzed("GET", "/%0A", {}, None))
    @example(request=Fuzzed("DELETE", "/adapters/%0D%0A", {}, None))
    def answers_cleanly(request: Fuzzed) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", fuzz_target.port, timeout=30)
        try:
            connection.request(request.method, request.path, request.body, request.headers)
            response = connection.getresponse()
            status, raw = response.status, response.read()
        finally:
            connection.close()
        counts[status] = counts.get(status, 0) + 1
        assert status != 500, raw
        if status < 400:
            return
        body = json.loads(raw)
        assert isinstance(body, dict) and isinstance(body.get("error"), str), raw
        assert isinstance(body.get("message"), str), raw
        if status >= 500:
            assert body["error"] in _SERVER_ANSWERS.get(status, set()), (request, body)

    answers_cleanly()

    assert fuzz_target.process.poll() is None, "the sidecar died"
    assert _get_text(fuzz_target.url, "/healthz")[0] == 200
    status, body = _post(fuzz_target.url, "/stage", {"adapter_id": "known", "lease": False})
    assert status == 200, body
    assert "unexpected error" not in fuzz_target.log_text()
    assert TOKEN not in fuzz_target.log_text()
    print(f"\nfuzzed answers by status: {dict(sorted(counts.items()))}")


@pytest.mark.parametrize(("rest", "status", "error"), [
    (b'"a"}', 200, None),
    (b'"a", "bogus": 1}', 400, "invalid_request"),
    (b'"a"', 400, "invalid_request"),
], ids=["whole", "unknown_field", "malformed"])
async def test_a_body_arriving_after_its_head_is_judged_as_one_sent_whole(
    tmp_path: Path, start_sidecar: StartSidecar, rest: bytes, status: int, error: str | None
) -> None:
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_sidecar(make_settings(tmp_path))
    first = b'{"adapter_id": '
    answered, answer = await raw_answer(sidecar.port, _stage_head(len(first) + len(rest)),
                                        first, later=rest)
    assert answered == status, answer
    if error is None:
        assert answer["adapter_id"] == "a" and answer["lease_id"], answer
    else:
        assert answer["error"] == error, answer


async def test_a_stage_body_sent_again_is_judged_as_the_first_time_and_kept_bodies_are_bounded(
    tmp_path: Path, start_sidecar: StartSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checked /stage bodies the sidecar keeps by their bytes (hit path) change no answer:
    the same bytes again get a fresh lease, a body refused is refused again and never kept,
    another id or option is judged on its own, and the kept bodies stay within their bound."""
    monkeypatch.setattr(api, "STAGE_BODIES_MAX", 8)
    for adapter_id in ("a", "b"):
        local_registry_adapter(tmp_path, adapter_id)
    sidecar = await start_sidecar(make_settings(tmp_path))
    assert sidecar._runner is not None
    kept = sidecar._runner.app[api.SERVICES].stage_bodies

    async def send(raw: bytes) -> tuple[int, dict[str, Any]]:
        return await raw_answer(sidecar.port, _stage_head(len(raw)), raw)

    plain = b'{"adapter_id": "a"}'
    leases = set()
    for _ in range(3):
        status, answer = await send(plain)
        assert status == 200 and answer["adapter_id"] == "a", answer
        leases.add(answer["lease_id"])
    assert len(leases) == 3 and None not in leases  # a lease per request, not per body
    assert isinstance(kept[plain], Mapping) and not isinstance(kept[plain], dict)  # read-only

    for refused in (b'{"adapter_id": "a", "bogus": 1}', b'{"adapter_id": "a", "timeout_s": 0}'):
        for _ in range(2):
            status, answer = await send(refused)
            assert status == 400 and answer["error"] == "invalid_request", (refused, answer)
        assert refused not in kept
    for _ in range(2):  # well-formed, so kept; the id is still judged on every request
        status, answer = await send(b'{"adapter_id": "../a"}')
        assert status == 400 and answer["error"] == "invalid_adapter_id", answer

    status, answer = await send(b'{"adapter_id": "a", "lease": false}')
    assert status == 200 and answer["lease_id"] is None, answer
    status, answer = await send(b'{"adapter_id": "b"}')
    assert status == 200 and answer["adapter_id"] == "b" and answer["lease_id"], answer

    long = b'{"adapter_id": "a"' + b" " * api.STAGE_BODY_KEPT_BYTES + b"}"
    status, answer = await send(long)
    assert status == 200 and answer["adapter_id"] == "a" and answer["lease_id"], answer
    assert long not in kept

    for timeout_s in range(1, 21):  # more distinct bodies than are kept
        status, answer = await send(b'{"adapter_id": "b", "timeout_s": %d}' % timeout_s)
        assert status == 200 and answer["adapter_id"] == "b", answer
        assert len(kept) <= 8
    status, answer = await send(plain)  # forgotten meanwhile: checked afresh
    assert status == 200 and answer["adapter_id"] == "a" and answer["lease_id"] not in leases
