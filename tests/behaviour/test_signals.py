"""Signals: the first SIGTERM stops gracefully, a second one while stopping exits at once."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from sidecar.validation.shapes import ModelShapes
from tests.support.processes import SidecarProcess, stage_blocking
from tests.support.s3 import S3Registry
from tests.support.waiting import eventually


async def test_a_second_sigterm_while_stopping_exits_at_once(
    tmp_path: Path, s3: S3Registry, sidecar_processes: list[SidecarProcess]
) -> None:
    shapes = ModelShapes(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                         num_key_value_heads=8, num_hidden_layers=16, head_dim=128)
    s3.put_adapter("big", rank=16, shapes=shapes,
                   target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj"))
    # A slow registry: the download is still running when the signals come, and a graceful
    # stop waits for it.
    s3.proxy.throttle_bytes_per_s = 128 * 1024
    cache = tmp_path / "cache"
    sidecar = SidecarProcess(
        ["--registry", s3.registry, "--s3-endpoint-url", s3.endpoint_url, "--cache-root",
         str(cache), "--part-size", "5MiB", "--download-concurrency", "2",
         "--min-free-disk", "0"], tmp_path / "sidecar.log")
    sidecar_processes.append(sidecar)
    stage = asyncio.create_task(asyncio.to_thread(stage_blocking, sidecar.url, "big", 60))
    await eventually(lambda: s3.proxy.gets("big/adapter_model"), timeout_s=10, poll_s=0.025,
                     what="the download of the weights started")

    sidecar.process.send_signal(signal.SIGTERM)
    await eventually(lambda: "stopping on signal" in sidecar.log_text(), timeout_s=10,
                     what="the first SIGTERM handled")
    # Time passing is the point: a stop that did not wait for the download would be over.
    await asyncio.sleep(1.0)
    assert sidecar.process.poll() is None, "the graceful stop did not wait for the download"
    sent_at = time.monotonic()
    sidecar.process.send_signal(signal.SIGTERM)
    returncode = await asyncio.to_thread(sidecar.process.wait, 10)

    assert time.monotonic() - sent_at < 3
    assert returncode == 1
    assert "second signal while stopping: exiting at once" in sidecar.log_text()
    await asyncio.gather(stage, return_exceptions=True)
