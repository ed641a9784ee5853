"""The byte path of the AWS Common Runtime (`awscrt.s3`, what s3transfer and `aws s3 cp` use
when it is installed), with the sidecar's checks: each object downloaded by the CRT's own
parallel ranged GETs straight into its file, then read back once in order for the SHA-256
(the content digest), the CRC-32 and the value check (no NaN or infinity in BF16/F16/F32
tensors), as the sidecar does for an object of more than one range. The CRT's own response
checksum validation is left off: the servers measured keep no checksums to compare with
(asked for, it cost s3rver's stage over twice the CPU), and the CRC-32 is computed here as the
sidecar computes it.

Runs in a venv of its own (benchmarks/.work/crt-venv: awscrt, numpy, isal): with awscrt in the
project's venv, botocore would sign the sidecar's own requests through the CRT too.

    python crt_get.py ENDPOINT REGION BUCKET DEST KEY:SIZE...   prints {"wall_s", "cpu_s"}
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import struct
import sys
import threading
import time
from urllib.parse import urlsplit

import numpy as np
from awscrt.auth import AwsCredentialsProvider
from awscrt.http import HttpHeaders, HttpRequest
from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
from awscrt.s3 import S3Client, S3RequestTlsMode, S3RequestType
from isal.isal_zlib import crc32

PART_BYTES = 8 * 1024 * 1024  # the sidecar's default part size and parallelism
CONNECTIONS = 32
CHUNK_BYTES = 1024 * 1024
_EXPONENT = {"BF16": (np.dtype("<u2"), 0x7F80), "F16": (np.dtype("<u2"), 0x7C00),
             "F32": (np.dtype("<u4"), 0x7F800000)}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _check(path: str) -> tuple[str, int, int]:
    """SHA-256, CRC-32 and the count of non-finite values, in one in-order pass."""
    digest = hashlib.sha256()
    crc = 0
    bad = 0
    spans: list[tuple[int, int, np.dtype[np.unsignedinteger], int]] = []
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        offset = 0
        while got := f.readinto(buffer):
            chunk = view[:got]
            digest.update(chunk)
            crc = crc32(chunk, crc)
            if offset == 0 and path.endswith(".safetensors"):
                (length,) = struct.unpack_from("<Q", chunk)
                header = json.loads(bytes(chunk[8:8 + length]))
                start = 8 + length
                for name, info in header.items():
                    if name != "__metadata__" and info["dtype"] in _EXPONENT:
                        word, mask = _EXPONENT[info["dtype"]]
                        begin, end = info["data_offsets"]
                        spans.append((start + begin, start + end, word, mask))
            for begin, end, word, mask in spans:
                lo, hi = max(begin, offset), min(end, offset + got)
                if lo < hi:
                    words = np.frombuffer(chunk[lo - offset:hi - offset], dtype=word)
                    bad += int(np.count_nonzero((words & mask) == mask))
            offset += got
    return digest.hexdigest(), crc, bad


def main() -> None:
    endpoint, region, bucket, dest = sys.argv[1:5]
    objects = [(key, int(size)) for key, size in (a.rsplit(":", 1) for a in sys.argv[5:])]
    host = urlsplit(endpoint)
    cpu_before, started = _cpu_s(), time.perf_counter()
    elg = EventLoopGroup()
    bootstrap = ClientBootstrap(elg, DefaultHostResolver(elg))
    credentials = AwsCredentialsProvider.new_static(os.environ["AWS_ACCESS_KEY_ID"],
                                                    os.environ["AWS_SECRET_ACCESS_KEY"])
    client = S3Client(bootstrap=bootstrap, region=region, credential_provider=credentials,
                      part_size=PART_BYTES, throughput_target_gbps=10.0,
                      tls_mode=(S3RequestTlsMode.ENABLED if host.scheme == "https"
                                else S3RequestTlsMode.DISABLED),
                      max_active_connections_override=CONNECTIONS)
    done = threading.Semaphore(0)
    failures: list[str] = []
    requests = []
    for key, _ in objects:
        headers = HttpHeaders([("host", host.netloc)])
        request = HttpRequest("GET", f"/{bucket}/{key}", headers)

        def finished(error: BaseException | None = None, status_code: int | None = None,
                     **_: object) -> None:
            if error is not None:
                failures.append(f"{error} ({status_code})")
            done.release()

        requests.append(client.make_request(
            type=S3RequestType.GET_OBJECT, request=request,
            recv_filepath=os.path.join(dest, key.rsplit("/", 1)[1]),
            on_done=finished))
    for _ in objects:
        done.acquire()
    transferred = time.perf_counter()
    if failures:
        raise SystemExit(f"awscrt failed: {failures}")
    for key, _ in objects:
        _, _, bad = _check(os.path.join(dest, key.rsplit("/", 1)[1]))
        if bad:
            raise SystemExit(f"{key}: {bad} non-finite values")
    print(json.dumps({"wall_s": time.perf_counter() - started, "cpu_s": _cpu_s() - cpu_before,
                      "transfer_s": transferred - started}))


if __name__ == "__main__":
    main()
