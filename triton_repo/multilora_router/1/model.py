"""Triton shell of the router: tensors in, `routing.route`, tensors out. The logic and its
tests live with routing.py; this file only converts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import routing
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        parameters = {
            key: value.get("string_value", "")
            for key, value in config.get("parameters", {}).items()
        }
        self._settings = routing.RouterSettings.from_deployment(parameters, os.environ)
        self._sidecar = routing.SidecarClient(self._settings)
        self._logger = pb_utils.Logger

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._answer(request) for request in requests]

    def _answer(self, request: Any) -> Any:
        try:
            text = routing.route(
                prompt=_text(request, "prompt"),
                adapter_id=_text(request, "adapter_id"),
                sampling_json=_optional_text(request, "sampling_parameters"),
                sidecar=self._sidecar,
                generate=self._generate,
                vllm_model=self._settings.vllm_model,
                warn=self._logger.log_warn,
            )
        except routing.RouteError as exc:
            code = getattr(pb_utils.TritonError, exc.status.value)
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(exc.message, code))
        output = pb_utils.Tensor("generated_text", np.array([text.encode("utf-8")], dtype=object))
        return pb_utils.InferenceResponse(output_tensors=[output])

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
