"""Send one prompt to Triton's multilora_router over gRPC and print the generated text.

Needs tritonclient with its gRPC part and numpy. In this repository's venv (the one `make run`
creates, which has no tritonclient) add the `triton` extra once:

    .venv/bin/pip install -e '.[triton]'

elsewhere `pip install 'tritonclient[grpc]' numpy`. Then, against the compose node of
compose/README.md's first start (Qwen3-0.6B with the adapter compose/adapters/alice-v1/):

    .venv/bin/python compose/client.py --adapter-id alice-v1 --prompt "Hello, my name is"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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
# The router answers UNAVAILABLE for what passes by itself (the catalog Triton has loaded does
# not list the adapter yet, a reload in progress, the sidecar restarting): worth waiting for.
DEFAULT_WAIT_S = 120.0
_BACKOFF_S = (1.0, 2.0, 3.0, 5.0)
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
MISSING_GRPC = (
    "tritonclient's gRPC support is not installed in this Python ({python}). In this "
    "repository's venv: .venv/bin/pip install -e '.[triton]'; elsewhere: "
    "pip install 'tritonclient[grpc]' numpy"
)
# What gRPC says when nothing answers at the address (as opposed to the router's own
# UNAVAILABLE answers, such as "sidecar unreachable").
_CONNECTION_FAILURES = ("failed to connect", "connection refused", "dns resolution failed",
                        "connection reset", "socket closed")


class TritonUnreachable(Exception):
    """Nothing answered gRPC at the URL."""


class GrpcMissing(Exception):
    """tritonclient is not installed, or without its gRPC part (the `http` extra alone)."""


def _grpc_client() -> Any:
    try:
        import tritonclient.grpc as grpcclient
    # tritonclient raises RuntimeError ("The installation does not include grpc support") when
    # only its http extra is installed; ImportError when it is not installed at all.
    except (ImportError, RuntimeError) as exc:
        raise GrpcMissing(MISSING_GRPC.format(python=sys.executable)) from exc
    return grpcclient


def generate(
    url: str,
    adapter_id: str,
    prompt: str,
    sampling_parameters: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> str:
    """The router's generated_text. Raises TritonUnreachable, or the router's error as
    tritonclient's InferenceServerException (status() and message() say what happened);
    GrpcMissing when this Python lacks tritonclient's gRPC part."""
    grpcclient = _grpc_client()
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
        # The router's own UNAVAILABLE about the sidecar quotes the sidecar's connection error
        # ("sidecar unreachable … Connection refused"): Triton answered, so it is waited out.
        if "unavailable" in str(exc.status()).lower() and "sidecar" not in message and any(
            failure in message for failure in _CONNECTION_FAILURES
        ):
            raise TritonUnreachable(exc.message()) from exc
        raise
    finally:
        client.close()
    answer = result.as_numpy("generated_text").reshape(-1)[0]
    return answer.decode("utf-8") if isinstance(answer, bytes) else str(answer)


def _is_unavailable(exc: Any) -> bool:
    return "unavailable" in str(exc.status()).lower()


def generate_waiting(
    url: str,
    adapter_id: str,
    prompt: str,
    sampling_parameters: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    wait_s: float = DEFAULT_WAIT_S,
    on_retry: Any = None,
) -> str:
    """generate(), asked again with backoff while the router answers UNAVAILABLE, for up to
    `wait_s` seconds in all; `on_retry(message, remaining_s)` is called before each wait."""
    from tritonclient.utils import InferenceServerException

    deadline = time.monotonic() + wait_s
    attempt = 0
    while True:
        try:
            return generate(url, adapter_id, prompt, sampling_parameters, timeout_s)
        except InferenceServerException as exc:
            remaining_s = deadline - time.monotonic()
            if not _is_unavailable(exc) or remaining_s <= 0:
                raise
            pause_s = min(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)], remaining_s)
            if on_retry is not None:
                on_retry(exc.message(), remaining_s)
            time.sleep(pause_s)
            attempt += 1


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
                        help=f"longest wait for one answer, a cold adapter's download included "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                        help="while the router answers UNAVAILABLE (the adapter not in the "
                             "catalog Triton has loaded yet, a reload, the sidecar restarting), "
                             f"ask again for up to this long; 0 to fail at once "
                             f"(default {DEFAULT_WAIT_S:g})")
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
    try:
        _grpc_client()
    except GrpcMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from tritonclient.utils import InferenceServerException

    if args.wait < 0 or args.timeout <= 0:
        print("error: --wait must be 0 or more and --timeout more than 0", file=sys.stderr)
        return EXIT_USAGE

    def retrying(message: str, remaining_s: float) -> None:
        print(f"waiting: UNAVAILABLE: {message} (asking again for up to {remaining_s:.0f} s)",
              file=sys.stderr)

    try:
        print(generate_waiting(args.url, args.adapter_id, args.prompt, sampling, args.timeout,
                               args.wait, retrying))
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
