"""Send one prompt to Triton's multilora_router over gRPC and print the generated text.

    python compose/client.py --adapter-id example-sql-v1 --prompt "List the tables"
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

MODEL = "multilora_router"
# The adapter id travels as this header too (gRPC metadata), so a routing proxy in front of
# many Triton nodes can hash on it; the router checks it against the adapter_id input.
ADAPTER_HEADER = "x-adapter-id"
DEFAULT_URL = "localhost:8001"
# A cold adapter is downloaded before generation starts; the router's own stage timeout is
# 300 s (its config.pbtxt), so wait a little longer than that by default.
DEFAULT_TIMEOUT_S = 360.0
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
# What gRPC says when nothing answers at the address (as opposed to the router's own
# UNAVAILABLE answers, such as "sidecar unreachable").
_CONNECTION_FAILURES = ("failed to connect", "connection refused", "dns resolution failed",
                        "connection reset", "socket closed")


class TritonUnreachable(Exception):
    """Nothing answered gRPC at the URL."""


def generate(
    url: str,
    adapter_id: str,
    prompt: str,
    sampling_parameters: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> str:
    """The router's generated_text. Raises TritonUnreachable, or the router's error as
    tritonclient's InferenceServerException (status() and message() say what happened)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    def text_input(name: str, value: str) -> Any:
        tensor = grpcclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=object))
        return tensor

    inputs = [text_input("prompt", prompt), text_input("adapter_id", adapter_id)]
    if sampling_parameters is not None:
        inputs.append(text_input("sampling_parameters", json.dumps(sampling_parameters)))
    client = grpcclient.InferenceServerClient(url)
    try:
        result = client.infer(
            MODEL, inputs, outputs=[grpcclient.InferRequestedOutput("generated_text")],
            client_timeout=timeout_s, headers={ADAPTER_HEADER: adapter_id},
        )
    except InferenceServerException as exc:
        message = (exc.message() or "").lower()
        if "unavailable" in str(exc.status()).lower() and any(
            failure in message for failure in _CONNECTION_FAILURES
        ):
            raise TritonUnreachable(exc.message()) from exc
        raise
    finally:
        client.close()
    answer = result.as_numpy("generated_text").reshape(-1)[0]
    return answer.decode("utf-8") if isinstance(answer, bytes) else str(answer)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=f"Generate text with one LoRA adapter through Triton's {MODEL}.")
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"Triton's gRPC endpoint, host:port (default {DEFAULT_URL})")
    parser.add_argument("--adapter-id", required=True, help="the adapter to generate with")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--sampling-parameters", metavar="JSON",
                        help='vLLM sampling parameters, e.g. \'{"max_tokens": 64}\' '
                             "(default: temperature 0, max_tokens 256)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"longest wait, a cold adapter's download included "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sampling: dict[str, Any] | None = None
    if args.sampling_parameters is not None:
        try:
            sampling = json.loads(args.sampling_parameters)
        except ValueError as exc:
            print(f"error: --sampling-parameters is not JSON: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if not isinstance(sampling, dict):
            print("error: --sampling-parameters must be a JSON object", file=sys.stderr)
            return EXIT_USAGE
    from tritonclient.utils import InferenceServerException

    try:
        print(generate(args.url, args.adapter_id, args.prompt, sampling, args.timeout))
    except TritonUnreachable as exc:
        print(f"error: cannot reach Triton's gRPC endpoint at {args.url} ({exc}); is Triton "
              "running, and is --url its gRPC port (8001 by default)?", file=sys.stderr)
        return EXIT_UNREACHABLE
    except InferenceServerException as exc:
        status = str(exc.status() or "error").removeprefix("StatusCode.")
        print(f"error: {status}: {exc.message()}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
