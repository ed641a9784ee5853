"""A sidecar restarted on a cache that already holds many adapters: how soon does it answer
ready, and does it fetch anything from the registry to get there? moto's S3 server (its own
process) is the registry; its access log counts what the restarted sidecar asked of it.

    python -m benchmarks.warm_restart [--adapters 1000] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3

from sidecar.process.examples import write_adapter
from tests.support.processes import free_port, http_status

BUCKET = "warm"


class Registry:
    """moto's S3 server: a process of its own, or one already running (`url`) whose access
    log is `log`; only the requests to BUCKET are counted, so it may serve others too."""

    def __init__(self, workdir: Path, url: str | None = None, log: Path | None = None) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        if url is not None and log is not None:
            self.url, self.log = url.rstrip("/"), log
            return
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "moto.log"
        with self.log.open("ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while http_status(self.url + "/moto-api/", timeout_s=1) != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("moto did not start")
            time.sleep(0.05)

    def requests(self) -> dict[str, int]:
        """Requests moto has answered so far, by kind."""
        counts = {"object GETs": 0, "listings": 0, "HEADs": 0}
        for line in self.log.read_text(errors="replace").splitlines():
            if f"GET /{BUCKET}?list-type" in line or f"GET /{BUCKET}/?" in line:
                counts["listings"] += 1
            elif f"GET /{BUCKET}/" in line:
                counts["object GETs"] += 1
            elif f"HEAD /{BUCKET}/" in line:
                counts["HEADs"] += 1
        return counts

    def stop(self) -> None:
        if self.process is not None:  # one already running is left to its owner
            self.process.terminate()
            self.process.wait(10)


def start_sidecar(registry: Registry, cache: Path, adapters: int, log: Path) -> tuple[
        subprocess.Popen[bytes], str, float]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORA_SIDECAR_")}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    began = time.monotonic()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", "--registry", f"s3://{BUCKET}/lora",
             "--s3-endpoint-url", registry.url, "--cache-root", str(cache),
             "--port", str(port), "--max-adapters", str(adapters + 10), "--min-free-disk", "0",
             "--log-level", "WARNING"], env=env, stdout=out, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}", began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3, help="restarts measured")
    parser.add_argument("--moto-url", default=None,
                        help="a moto S3 server already running, instead of starting one "
                        "(with --moto-log: benchmarks/run.sh --quick passes its own)")
    parser.add_argument("--moto-log", type=Path, default=None,
                        help="that server's access log, where the requests are counted")
    args = parser.parse_args(argv)
    if (args.moto_url is None) != (args.moto_log is None):
        parser.error("--moto-url and --moto-log go together")
    with tempfile.TemporaryDirectory(prefix="warm-restart-") as tmp:
        work = Path(tmp)
        registry = Registry(work, args.moto_url, args.moto_log)
        try:
            s3 = boto3.client("s3", endpoint_url=registry.url, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
            s3.create_bucket(Bucket=BUCKET)
            ids = [f"tenant-{n:04d}-v1" for n in range(args.adapters)]

            def upload(index: int) -> None:
                folder = work / "uploads" / ids[index]
                write_adapter(folder, rank=2, target_modules=("q_proj",), seed=index)
                for path in folder.iterdir():
                    s3.put_object(Bucket=BUCKET, Key=f"lora/{ids[index]}/{path.name}",
                                  Body=path.read_bytes())

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(upload, range(args.adapters)))
            cache = work / "cache"
            process, url, _ = start_sidecar(registry, cache, args.adapters, work / "sidecar.log")

            def stage(adapter_id: str) -> None:
                request = urllib.request.Request(
                    url + "/stage", method="POST",
                    data=json.dumps({"adapter_id": adapter_id, "lease": False}).encode(),
                    headers={"Content-Type": "application/json"})
                urllib.request.urlopen(request, timeout=120).close()

            while http_status(url + "/healthz", timeout_s=1) != 200:
                time.sleep(0.05)
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(stage, ids))
            process.terminate()
            process.wait(30)
            rows = []
            for _ in range(args.runs):
                before = registry.requests()
                process, url, began = start_sidecar(registry, cache, args.adapters,
                                                    work / "sidecar.log")
                healthz = ready = None
                while ready is None and time.monotonic() - began < 120:
                    if healthz is None and http_status(url + "/healthz", timeout_s=1) == 200:
                        healthz = time.monotonic() - began
                    if http_status(url + "/readyz", timeout_s=1) == 200:
                        ready = time.monotonic() - began
                    time.sleep(0.01)
                with urllib.request.urlopen(url + "/adapters", timeout=30) as response:
                    cached = len(json.loads(response.read())["adapters"])
                process.terminate()
                process.wait(30)
                after = registry.requests()
                rows.append((healthz, ready, cached,
                             {k: after[k] - before[k] for k in after}))
        finally:
            registry.stop()
    print(f"sidecar restarted on a cache of {args.adapters} adapters ({args.runs} restarts; "
          "time from the process's start)")
    print("| run | /healthz s | /readyz s | adapters kept | object GETs | HEADs | listings |")
    print("|---|---|---|---|---|---|---|")
    for n, (healthz, ready, cached, calls) in enumerate(rows, 1):
        print(f"| {n} | {healthz or float('nan'):.2f} | {ready or float('nan'):.2f} | {cached} | "
              f"{calls['object GETs']} | {calls['HEADs']} | {calls['listings']} |")
    readies = [r[1] for r in rows if r[1] is not None]
    if readies:
        print(f"median /readyz: {statistics.median(readies):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
