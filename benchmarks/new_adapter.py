"""A new adapter's way to its first answer with the real engine (vLLM on CPU behind the stock
Triton backend, the engine tier's node): with spare catalog names, and with `--spare-names 0`
(every new adapter costs a reload, in each reload mode), side by side in one run, with what
another tenant calling all along saw meanwhile.

Usage: python -m benchmarks.new_adapter [--adapters 3] [--reload-adapters 1] [--no-unload-first]
Needs the engine environment (make engine-env, or LORA_ENGINE_VENV) and the stock backend
(TRITON_VLLM_BACKEND_DIR, ../shared/vendor/vllm_backend, or a clone of its tag).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.engine_bench import engine_bench, markdown_table
from tests.engine.harness import (
    REPO_ROOT,
)
from tests.engine.node import EngineNode, start_node
from tests.engine.surgery import variant

CACHE = REPO_ROOT / "benchmarks" / ".work" / "engine"
BACKOFF_S = 0.25  # what the other tenant's client waits after a failed call


@dataclass
class Phase:
    name: str
    upload_to_answer_s: list[float] = field(default_factory=list)
    download_to_answer_s: list[float] = field(default_factory=list)
    repository_calls: int = 0
    wrong_answers: int = 0
    other_calls: int = 0
    other_errors: int = 0


class OtherTenant:
    """Calls one adapter through the router in a loop, counting answers and errors."""

    def __init__(self, node: EngineNode, adapter_id: str, expected: str) -> None:
        self._node, self._adapter_id, self._expected = node, adapter_id, expected
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="other-tenant")
        self.calls = 0
        self.errors = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ok = self._node.ask(self._adapter_id) == self._expected
            except Exception:
                ok = False
            self.calls += 1
            if not ok:
                self.errors += 1
                self._stop.wait(BACKOFF_S)

    @contextmanager
    def running(self) -> Iterator[OtherTenant]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def loads(node: EngineNode) -> float:
    with urllib.request.urlopen(node.sidecar.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lora_sidecar_triton_reloads_total{"))


def measure(node: EngineNode, phase: Phase, adapters: dict[str, tuple[Path, str]],
            steady: str) -> Phase:
    before = loads(node)
    with OtherTenant(node, "steady", steady).running() as other:
        for adapter_id, (folder, expected) in adapters.items():
            uploaded = time.time()
            node.upload(adapter_id, folder)
            text, _, _ = node.ask_until_served(adapter_id, timeout_s=600)
            answered = time.time()
            phase.wrong_answers += text != expected
            phase.upload_to_answer_s.append(answered - uploaded)
            phase.download_to_answer_s.append(answered - node.staged_at(adapter_id))
        time.sleep(1)  # the other tenant's calls just after the last answer count too
    phase.repository_calls = int(loads(node) - before)
    phase.other_calls, phase.other_errors = other.calls, other.errors
    return phase


def table(phases: list[Phase]) -> str:
    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} / {max(values):.2f}" if values else "-"

    rows = [("mode", "new adapters", "upload -> 1st answer s (median / max)",
             "end of download -> 1st answer s", "engine loads", "other tenant calls / errors",
             "wrong answers")]
    for p in phases:
        rows.append((p.name, str(len(p.upload_to_answer_s)), spread(p.upload_to_answer_s),
                     spread(p.download_to_answer_s), str(p.repository_calls),
                     f"{p.other_calls} / {p.other_errors}", str(p.wrong_answers)))
    return markdown_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=3,
                        help="new adapters served through spare names (default 3)")
    parser.add_argument("--reload-adapters", type=int, default=1,
                        help="new adapters per --spare-names 0 mode, each a reload (default 1)")
    parser.add_argument("--no-unload-first", action="store_true",
                        help="skip the --spare-names 0 --triton-reload unload-first phase")
    args = parser.parse_args(argv)
    modes = [("spare names (default 32)", [], args.adapters),
             ("--spare-names 0, on-change", ["--spare-names", "0"], args.reload_adapters)]
    if not args.no_unload_first:
        modes.append(("--spare-names 0, unload-first",
                      ["--spare-names", "0", "--triton-reload", "unload-first"],
                      args.reload_adapters))
    phases: list[Phase] = []
    with engine_bench() as bench, tempfile.TemporaryDirectory(prefix="new-adapter-") as scratch:
        assets = bench.assets
        work = Path(scratch)
        folders = {}
        for n in range(sum(count for _, _, count in modes)):
            folders[f"bench-{n}"] = variant(assets.adapter(f"tenant-{n % 4}"), work / f"v{n}",
                                            lora_alpha=3.0 + 5.0 * n)
        references = assets.references(folders)
        node = start_node(assets, work / "node", bench.moto_url, bench.backend,
                          adapters={"steady": assets.adapter("tenant-0")},
                          sidecar_args=["--log-format", "json"])
        try:
            node.load_router()
            steady = assets.text("tenant-0")
            names = iter(folders)
            for index, (name, sidecar_args, count) in enumerate(modes):
                if index:
                    node.restart_sidecar(sidecar_args)
                    node.wait_catalog_loaded()
                batch = {}
                for _ in range(count):
                    adapter_id = next(names)
                    batch[adapter_id] = (folders[adapter_id], references[adapter_id].text or "")
                print(f"measuring: {name} ({count} new adapters)", flush=True)
                phases.append(measure(node, Phase(name), batch, steady))
        finally:
            node.stop()
    print()
    print("A new adapter's first answer through the router, vLLM 0.13 on CPU (tiny Llama); "
          f"another tenant calls its adapter all along (waiting {BACKOFF_S:g} s after a failure)")
    print(table(phases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
