"""What every engine benchmark sets up (the engine environment, the tiny model's assets, the
stock backend, a moto registry) and how it prints its table."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from moto.server import ThreadedMotoServer

from tests.engine.harness import (
    REPO_ROOT,
    EngineAssets,
    build_assets,
    ensure_engine_env,
    find_vllm_backend,
)

CACHE = REPO_ROOT / "benchmarks" / ".work" / "engine"


@dataclass(frozen=True)
class EngineBench:
    assets: EngineAssets
    backend: Path  # the stock Triton vLLM backend's files
    moto_url: str


@contextmanager
def engine_bench() -> Iterator[EngineBench]:
    """The engine's environment and assets (built once, kept in benchmarks/.work/), the stock
    backend, and a moto S3 server for the run; SystemExit when the backend cannot be found."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's access log
    env = ensure_engine_env()
    CACHE.mkdir(parents=True, exist_ok=True)
    assets = build_assets(env, CACHE)
    backend = find_vllm_backend(CACHE)
    if backend.path is None:
        raise SystemExit("the stock Triton vLLM backend was not found: " + backend.fix())
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    try:
        yield EngineBench(assets, backend.path, f"http://{host}:{port}")
    finally:
        moto.stop()


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table, the first row its header, the columns padded to line up."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |"
             for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
