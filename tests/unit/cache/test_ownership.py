"""One process owns a cache root: a second `serve` on the same cache (another port, or the
same one, as a second `make run` would) exits at once, naming the cache and its owner, and
touches nothing; a killed owner never blocks its successor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import (
    SidecarProcess,
    free_port,
    get_blocking,
    post_blocking,
    stage_blocking,
)
from tests.support.settings import local_registry_adapter
from tests.support.waiting import eventually_blocking

SECOND_START_TIMEOUT_S = 30
EXIT_CACHE_OWNED = 3  # the README's exit code for "another process owns the cache root"


def serve_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--registry", str(tmp_path / "registry"), "--cache-root", str(tmp_path / "cache"),
            "--min-free-disk", "0", *extra]


def run_second(tmp_path: Path, port: int, *extra: str) -> tuple[subprocess.CompletedProcess[str],
                                                                   float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--port", str(port),
         *serve_args(tmp_path, *extra)],
        capture_output=True, text=True, timeout=SECOND_START_TIMEOUT_S,
    )
    return done, time.monotonic() - started


def wait_catalog_lists(url: str, adapter_ids: set[str], timeout_s: float = 30) -> None:
    """The first process names each new adapter in its catalog on its own (by its own name in
    a generation rendered after it was staged, or by a spare bound to it, whichever came
    first): the snapshot is taken once that work is done, so only a second process could
    change it afterwards."""

    def listed() -> bool:
        status, body = get_blocking(url, "/catalog")
        if status != 200 or not isinstance(body.get("adapter_ids"), list):
            return False
        named = set(body["adapter_ids"])
        named |= {version.split("@")[0] for version in body["spares"]["bound"].values()}
        return adapter_ids <= named

    eventually_blocking(listed, timeout_s=timeout_s, poll_s=0.1,
                        what=lambda: f"the catalog listing {adapter_ids} "
                                     f"({get_blocking(url, '/catalog')[1]})")


def cache_state(cache: Path) -> dict[str, object]:
    """Everything a second process could have changed: names under the cache, and sizes."""
    return {str(p.relative_to(cache)): (p.stat().st_size if p.is_file() else "dir")
            for p in sorted(cache.rglob("*")) if p.name != ".leases"}


def settled_state(cache: Path, timeout_s: float = 10) -> dict[str, object]:
    """The cache once the first process's own follow-up writes (the catalog's journal after a
    new generation) are done: unchanged over half a second."""
    last: list[dict[str, object]] = []

    def unchanged() -> tuple[dict[str, object]] | None:
        state = cache_state(cache)
        same = [state] == last
        last[:] = [state]
        return (state,) if same else None

    # The first look has nothing to compare with: the cache is read every half second until
    # two reads in a row agree.
    return eventually_blocking(unchanged, timeout_s=timeout_s, poll_s=0.5,
                               what="the first process to stop writing its cache")[0]


@pytest.mark.parametrize("same_port", [False, True], ids=["other port", "same port"])
def test_a_second_serve_on_the_same_cache_exits_at_once_and_touches_nothing(
    tmp_path: Path, sidecar_processes: list[SidecarProcess], same_port: bool
) -> None:
    for seed, adapter_id in enumerate(("a", "b")):
        local_registry_adapter(tmp_path, adapter_id, seed=seed)
    first = SidecarProcess(serve_args(tmp_path), tmp_path / "first.log")
    sidecar_processes.append(first)
    leases = {}
    for adapter_id in ("a", "b"):  # leased, as by requests in flight
        status, body = stage_blocking(first.url, adapter_id, 30)
        assert status == 200, body
        leases[adapter_id] = body["lease_id"]
    cache = tmp_path / "cache"
    # What the first process has in flight: a download in .staging/ and a folder awaiting
    # deletion in .trash/ (a second process's start-up clean-up would empty both).
    download = cache / ".staging" / "c.0123456789ab"
    download.mkdir()
    (download / "adapter_model.safetensors").write_bytes(b"x" * 4096)
    (cache / ".trash" / "old.0123456789ab").mkdir()
    wait_catalog_lists(first.url, {"a", "b"})
    before = settled_state(cache)

    # A smaller budget: a second owner would evict the leased adapters to meet it at once.
    done, elapsed_s = run_second(tmp_path, first.port if same_port else free_port(),
                                 "--max-adapters", "1")

    assert done.returncode == EXIT_CACHE_OWNED, done.stderr
    assert elapsed_s < 10, f"the second process took {elapsed_s:.1f}s to give up"
    message = done.stderr
    assert str(cache) in message
    assert f"pid {first.pid}" in message and f"port {first.port}" in message
    assert os.uname().nodename in message
    assert cache_state(cache) == before
    owner = json.loads((cache / ".owner.json").read_text())
    assert (owner["pid"], owner["port"]) == (first.pid, first.port)
    # The first one never noticed: its leases hold, its adapters are served.
    for adapter_id in ("a", "b"):
        status, body = stage_blocking(first.url, adapter_id, 30, lease=False)
        assert status == 200 and body["cached"] is True, body
    for adapter_id, lease_id in leases.items():
        status, body = post_blocking(first.url, "/release", {"lease_id": lease_id})
        assert status == 200 and body["adapter_id"] == adapter_id, body


def test_a_killed_owner_leaves_the_cache_to_its_successor(
    tmp_path: Path, sidecar_processes: list[SidecarProcess]
) -> None:
    local_registry_adapter(tmp_path, "a")
    first = SidecarProcess(serve_args(tmp_path), tmp_path / "first.log")
    sidecar_processes.append(first)
    assert stage_blocking(first.url, "a", 30, lease=False)[0] == 200
    first.kill()  # no clean-up: the kernel drops the lock with the process

    second = SidecarProcess(serve_args(tmp_path), tmp_path / "second.log")
    sidecar_processes.append(second)
    status, body = stage_blocking(second.url, "a", 30, lease=False)
    assert status == 200 and body["cached"] is True
    owner = json.loads((tmp_path / "cache" / ".owner.json").read_text())
    assert (owner["pid"], owner["port"]) == (second.pid, second.port)
    second.stop()  # a clean stop gives the cache up too
    third = SidecarProcess(serve_args(tmp_path), tmp_path / "third.log")
    sidecar_processes.append(third)
    assert stage_blocking(third.url, "a", 30, lease=False)[0] == 200


def test_validate_and_examples_work_beside_a_running_owner(
    tmp_path: Path, sidecar_processes: list[SidecarProcess]
) -> None:
    folder = local_registry_adapter(tmp_path, "a")
    first = SidecarProcess(serve_args(tmp_path), tmp_path / "first.log")
    sidecar_processes.append(first)
    env = {**os.environ, "LORA_SIDECAR_CACHE_ROOT": str(tmp_path / "cache")}
    checked = subprocess.run([sys.executable, "-m", "sidecar", "validate", str(folder)],
                             capture_output=True, text=True, timeout=60, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    written = subprocess.run([sys.executable, "-m", "sidecar", "examples",
                              str(tmp_path / "new-registry")],
                             capture_output=True, text=True, timeout=60, env=env)
    assert written.returncode == 0, written.stderr
    assert sorted(p.name for p in (tmp_path / "new-registry").iterdir())
    assert stage_blocking(first.url, "a", 30, lease=False)[0] == 200



def test_a_second_view_of_the_same_volume_is_refused_too(
    tmp_path: Path, sidecar_processes: list[SidecarProcess]
) -> None:
    """As two containers mounting one volume at their own paths: a bind mount of the cache."""
    local_registry_adapter(tmp_path, "a")
    first = SidecarProcess(serve_args(tmp_path), tmp_path / "first.log")
    sidecar_processes.append(first)
    assert stage_blocking(first.url, "a", 30)[0] == 200
    view = tmp_path / "other-container" / "lora-cache"
    view.mkdir(parents=True)
    bound = subprocess.run(["mount", "--bind", str(tmp_path / "cache"), str(view)],
                           capture_output=True, text=True, timeout=30)
    if bound.returncode != 0:
        pytest.fail(f"cannot bind-mount the cache (uid {os.getuid()}): {bound.stderr.strip()}; "
                    "this test needs root or CAP_SYS_ADMIN, as in CI")
    try:
        wait_catalog_lists(first.url, {"a"})
        before = settled_state(view)
        done = subprocess.run(
            [sys.executable, "-m", "sidecar", "serve", "--port", str(free_port()),
             "--registry", str(tmp_path / "registry"), "--cache-root", str(view),
             "--max-adapters", "1", "--min-free-disk", "0"],
            capture_output=True, text=True, timeout=SECOND_START_TIMEOUT_S)
        assert done.returncode == EXIT_CACHE_OWNED, done.stderr
        assert f"pid {first.pid}" in done.stderr and str(view) in done.stderr
        assert cache_state(view) == before
    finally:
        subprocess.run(["umount", "-l", str(view)], capture_output=True, timeout=30)
