"""Triton shell of the router: tensors in, `routing.route`, tensors out. Each request is
answered from a worker thread, and `execute` returns at once: Triton 2.51 runs one `execute`
per instance at a time, so a request waiting for a cold download would hold every warm one
behind it. Clients see plain unary infer; `max_concurrent_requests` bounds the threads."""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import routing
import triton_python_backend_utils as pb_utils
from routing import RouteError, requested_adapter_id

_CODES = ("NOT_FOUND", "UNAVAILABLE", "INVALID_ARG", "INTERNAL", "UNSUPPORTED")


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        parameters = {key: value.get("string_value", "") for key, value in
                      json.loads(args["model_config"]).get("parameters", {}).items()}
        self._settings = routing.RouterSettings.from_deployment(parameters, os.environ)
        self._sidecar = routing.SidecarClient(self._settings)
        self._finished_streams = _FinishedStreams()
        self._pool = ThreadPoolExecutor(self._settings.max_concurrent_requests, "router")
        try:  # response parameters came with Triton 24.11; 2.51 (the tests') has only tensors
            self._parameters = bool(pb_utils.InferenceResponse(output_tensors=[], parameters={}))
        except TypeError:
            self._parameters = False
            pb_utils.Logger.log_info("router: this Python backend has no response parameters")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:  # Triton frees the request's tensors when execute returns: read them now
                call = (_text(request, "prompt", required=True), requested_adapter_id(
                    _text(request, "adapter_id"), request.parameters(),
                    self._settings.adapter_id_header), _text(request, "sampling_parameters"),
                    request.request_id())
            except RouteError as exc:
                self._send(sender, _error(exc.status, exc.message))
                continue
            self._pool.submit(self._answer, *call, sender)

    def finalize(self) -> None:  # requests in progress are answered before the model goes
        self._pool.shutdown(wait=True)
        self._sidecar.close()

    def _answer(self, prompt: str, adapter_id: str, sampling_json: str | None, request_id: str,
                sender: Any) -> None:
        leases: list[routing.Lease] = []
        try:
            text = routing.route(prompt, adapter_id, sampling_json, self._sidecar,
                                 self._generate, pb_utils.Logger.log_warn, leases.append)
            facts = routing.provenance(leases[-1])
            outputs = [_tensor("generated_text", text)] + [_tensor(*f) for f in facts.items()]
            pb_utils.Logger.log_info(routing.provenance_line(request_id, leases[-1]))
            response = pb_utils.InferenceResponse(output_tensors=outputs, **(
                {"parameters": facts} if self._parameters else {}))
        except RouteError as exc:
            response = _error(exc.status, exc.message)
        except Exception as exc:  # a thread has no caller to raise to: the client must hear
            pb_utils.Logger.log_error(f"multilora_router failed on {adapter_id}: {exc!r}")
            response = _error("INTERNAL", f"multilora_router failed: {exc!r}")
        self._send(sender, response)

    def _send(self, sender: Any, response: Any) -> None:
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # the client went away, or Triton is stopping
            pb_utils.Logger.log_warn(f"multilora_router could not send a response: {exc!r}")

    def _generate(self, prompt: str, sampling_json: str) -> Iterator[str]:
        """A decoupled BLS call to the vLLM model; yields each text_output piece."""
        request = pb_utils.InferenceRequest(
            model_name=self._settings.vllm_model, requested_output_names=["text_output"],
            inputs=[_tensor("text_input", prompt),
                    pb_utils.Tensor("exclude_input_in_output", np.array([True], dtype=bool)),
                    _tensor("sampling_parameters", sampling_json)])
        try:
            responses = request.exec(decoupled=True)
            self._finished_streams.keep(responses)
            for response in responses:
                if response.has_error():
                    code = [n for n in _CODES if getattr(pb_utils.TritonError, n, 0) ==
                            response.error().code()]  # TritonError exists only once loaded
                    raise routing.VllmError(response.error().message(), (code or [None])[0])
                tensor = pb_utils.get_output_tensor_by_name(response, "text_output")
                if tensor is not None:  # a decoupled model may end with an empty final response
                    for piece in tensor.as_numpy().reshape(-1):
                        yield piece.decode("utf-8") if isinstance(piece, bytes) else str(piece)
        except pb_utils.TritonModelException as exc:
            raise routing.VllmError(str(exc)) from exc


class _FinishedStreams:
    """Each BLS response stream stays referenced for KEEP_S after it began, so its last reference
    (and its text_output arrays) is dropped by a thread holding the GIL. The stub erases each
    finished decoupled stream on its clean-up thread without the GIL (Triton 2.51, pb_stub.cc,
    Stub::SendCleanupId); dropping the last reference there, numpy reported "Reference count
    error ... dtype 17 (O)" and the stub died (segmentation fault) under load (commit bcefc72)."""

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


def _tensor(name: str, text: str) -> Any:
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=object))


def _error(status: str, message: str) -> Any:  # a status Triton lacks is INTERNAL
    code = getattr(pb_utils.TritonError, status, pb_utils.TritonError.INTERNAL)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _text(request: Any, name: str, required: bool = False) -> str | None:  # one string, or None
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    values = tensor.as_numpy().reshape(-1) if tensor is not None else []
    if len(values) != 1 and (required or tensor is not None):
        raise RouteError("INVALID_ARG", f"input {name} must hold one string, not {len(values)}")
    try:
        return None if tensor is None else (
            values[0].decode() if isinstance(values[0], bytes) else str(values[0]))
    except UnicodeDecodeError as exc:
        raise RouteError("INVALID_ARG", f"{name} is not valid UTF-8: {exc}") from exc
