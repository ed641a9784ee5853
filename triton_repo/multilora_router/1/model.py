"""Triton shell of the router: tensors in, `routing.route`, tensors out. The logic lives in
routing.py and the router_*.py modules beside it, tested without Triton; this file only converts.

Each request is answered from a worker thread through its response sender, and `execute`
returns at once: a non-decoupled Python model in Triton 2.51 runs one `execute` per instance
at a time, so a request that waits minutes for a cold adapter's download would otherwise hold
the instance, and every warm request queued behind it would wait too. Clients see no
difference (one response per request, plain unary infer); the thread pool's size
(`max_concurrent_requests`) bounds the requests in progress per instance.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import routing
import triton_python_backend_utils as pb_utils


@dataclass(frozen=True, slots=True)
class _Call:
    """What a worker thread needs of a request: Triton frees its tensors when execute returns."""

    prompt: str
    adapter_id: str
    sampling_json: str | None
    request_id: str


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        parameters = {
            key: value.get("string_value", "")
            for key, value in config.get("parameters", {}).items()
        }
        self._settings = routing.RouterSettings.from_deployment(parameters, os.environ)
        self._sidecar = routing.SidecarClient(self._settings)
        self._holds = routing.Holds(self._settings)
        self._finished_streams = _FinishedStreams()
        self._logger = pb_utils.Logger
        self._pool = ThreadPoolExecutor(max_workers=self._settings.max_concurrent_requests,
                                        thread_name_prefix="router")
        # Response parameters came with the Python backend of Triton 24.11; the 2.51 build the
        # tests run (nvidia-pytriton) has none. The output tensors carry the same facts.
        try:
            pb_utils.InferenceResponse(output_tensors=[], parameters={})
            self._parameters = True
        except TypeError:
            self._parameters = False
            self._logger.log_info("multilora_router: this Python backend has no response "
                                  "parameters; content_digest, signer and signer_identity "
                                  "are answered as output tensors only")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                call = self._read(request)
            except routing.RouteError as exc:
                self._send(sender, _error_response(exc))
                continue
            self._pool.submit(self._answer, call, sender)
        return None

    def finalize(self) -> None:
        # Requests in progress are answered before the model goes (an unload waits for them).
        self._pool.shutdown(wait=True)
        self._sidecar.close()

    def _read(self, request: Any) -> _Call:
        adapter_id = routing.requested_adapter_id(
            _optional_text(request, "adapter_id"), request.parameters(),
            self._settings.adapter_id_header)
        return _Call(_text(request, "prompt"), adapter_id,
                     _optional_text(request, "sampling_parameters"), request.request_id())

    def _answer(self, call: _Call, sender: Any) -> None:
        leases: list[routing.Lease] = []
        try:
            text = routing.route(
                prompt=call.prompt,
                adapter_id=call.adapter_id,
                sampling_json=call.sampling_json,
                sidecar=self._sidecar,
                generate=self._generate,
                vllm_model=self._settings.vllm_model,
                warn=self._logger.log_warn,
                holds=self._holds,
                info=self._logger.log_info,
                on_lease=leases.append,
            )
            response = self._response(text, leases[-1], call.request_id)
        except routing.RouteError as exc:
            response = _error_response(exc)
        except Exception as exc:  # a thread has no caller to raise to: the client must hear
            self._logger.log_error(f"multilora_router failed on {call.adapter_id}: {exc!r}")
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"multilora_router failed: {exc!r}", pb_utils.TritonError.INTERNAL))
        self._send(sender, response)

    def _response(self, text: str, lease: routing.Lease, request_id: str) -> Any:
        """generated_text, and which adapter bytes answered it (the content digest and who
        signed them): response parameters, output tensors, and a log line with the request id."""
        facts = routing.provenance(lease)
        outputs = [_text_tensor("generated_text", text)]
        outputs += [_text_tensor(name, facts[name]) for name in routing.PROVENANCE]
        self._logger.log_info(routing.provenance_line(request_id, lease))
        if self._parameters:
            return pb_utils.InferenceResponse(output_tensors=outputs, parameters=facts)
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def _send(self, sender: Any, response: Any) -> None:
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # the client went away, or Triton is stopping
            self._logger.log_warn(f"multilora_router could not send a response: {exc!r}")

    def _generate(self, prompt: str, sampling_json: str) -> Iterator[str]:
        """A decoupled BLS call to the vLLM model; yields each text_output piece."""
        request = pb_utils.InferenceRequest(
            model_name=self._settings.vllm_model,
            requested_output_names=["text_output"],
            inputs=[
                pb_utils.Tensor("text_input", np.array([prompt.encode("utf-8")], dtype=object)),
                pb_utils.Tensor("exclude_input_in_output", np.array([True], dtype=bool)),
                pb_utils.Tensor("sampling_parameters",
                                np.array([sampling_json.encode("utf-8")], dtype=object)),
            ],
        )
        try:
            responses = request.exec(decoupled=True)
            self._finished_streams.keep(responses)
            for response in responses:
                if response.has_error():
                    error = response.error()
                    raise routing.VllmError(error.message(), _code_name(error))
                tensor = pb_utils.get_output_tensor_by_name(response, "text_output")
                # A decoupled model may close the stream with an empty final response.
                if tensor is not None:
                    for piece in tensor.as_numpy().reshape(-1):
                        yield piece.decode("utf-8") if isinstance(piece, bytes) else str(piece)
        except pb_utils.TritonModelException as exc:
            raise routing.VllmError(str(exc)) from exc


class _FinishedStreams:
    """Each BLS response stream stays referenced here for KEEP_S after it began, so that its
    last reference, and with it the numpy arrays of its text_output tensors, is dropped by a
    Python thread holding the GIL.

    The Python backend's stub keeps each decoupled BLS stream in a map of its own and erases
    it on its clean-up thread, without the GIL, once the last response has been read (seen in
    Triton 2.51, python_backend's src/pb_stub.cc, Stub::SendCleanupId). When that erase drops
    the last reference, the arrays are freed there, racing the router's threads: numpy reports
    "Reference count error detected: an attempt was made to deallocate the dtype 17 (O)" and
    the stub dies with a segmentation fault (the Triton tier, 16 clients for 120 s: both stubs
    dead in each of 2 runs; with this, 71,152 calls answered, none failed). The clean-up is one
    message to the parent, done in milliseconds; KEEP_S covers a loaded machine many times."""

    KEEP_S = 10.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: collections.deque[tuple[float, Any]] = collections.deque()

    def keep(self, stream: Any) -> None:
        now = time.monotonic()
        with self._lock:
            self._kept.append((now, stream))
            while self._kept[0][0] < now - self.KEEP_S:
                self._kept.popleft()  # the stub let go of it long ago: freed here, GIL held


def _text_tensor(name: str, text: str) -> Any:
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=object))


def _error_response(exc: routing.RouteError) -> Any:
    code = getattr(pb_utils.TritonError, exc.status.value)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(exc.message, code))


def _code_name(error: Any) -> str | None:
    code = error.code()
    for name in ("NOT_FOUND", "UNAVAILABLE", "INVALID_ARG", "INTERNAL", "UNSUPPORTED"):
        if code == getattr(pb_utils.TritonError, name, None):
            return name
    return None


def _optional_text(request: Any, name: str) -> str | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise routing.RouteError(routing.Status.INVALID_ARG,
                                 f"{name} must hold exactly one string, got {values.size}")
    value = values[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise routing.RouteError(routing.Status.INVALID_ARG,
                                     f"{name} is not valid UTF-8: {exc}") from exc
    return str(value)


def _text(request: Any, name: str) -> str:
    value = _optional_text(request, name)
    if value is None:
        raise routing.RouteError(routing.Status.INVALID_ARG, f"input {name} is missing")
    return value
