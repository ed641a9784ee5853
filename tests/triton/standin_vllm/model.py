"""A CPU stand-in for Triton's stock vLLM backend, installed by the tests as the Python-based
backend `vllm`, so `vllm_model`'s checked-in config runs unchanged. It keeps the stock
backend's contract (triton-inference-server/vllm_backend src/model.py, src/utils/request.py)
and the real engine's behaviours the sidecar relies on (../../../../shared/ENGINE.md): the
catalog read once per load; an adapter folder read on the first use of its int id (its
position in the catalog) and cached; a folder vLLM cannot load kills the whole engine, which
then fails every request; with ENABLE_VLLM_HEALTH_CHECK the next request finds the engine
dead, asks Triton to unload the model and is answered UNAVAILABLE.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from answer import answer_words, load_adapter

_ENGINE_ARGS_FILENAME = "model.json"
_MULTI_LORA_FILENAME = "multi_lora.json"
# Simulated generation time per request, for measurements that need requests to overlap.
_DELAY_ENV = "STANDIN_VLLM_DELAY_S"
# While the file this names exists, loading fails the way an engine out of GPU memory does.
_FAIL_FLAG_ENV = "STANDIN_VLLM_FAIL_FLAG"
# Seconds a model load takes (a real engine takes 30-40 s on CPU), to observe a reload.
_LOAD_DELAY_ENV = "STANDIN_VLLM_LOAD_DELAY_S"
# A file where each adapter folder read is logged ("<int id> <name> <path>" per line).
_READS_ENV = "STANDIN_VLLM_READS"

_INPUTS = [
    ("text_input", "TYPE_STRING", [1], False),
    ("image", "TYPE_STRING", [-1], True),
    ("stream", "TYPE_BOOL", [1], True),
    ("sampling_parameters", "TYPE_STRING", [1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
    ("return_finish_reason", "TYPE_BOOL", [1], True),
    ("return_cumulative_logprob", "TYPE_BOOL", [1], True),
    ("return_logprobs", "TYPE_BOOL", [1], True),
    ("return_num_input_tokens", "TYPE_BOOL", [1], True),
    ("return_num_output_tokens", "TYPE_BOOL", [1], True),
    ("embedding_request", "TYPE_STRING", [1], True),
]
_OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("finish_reason", "TYPE_STRING", [-1]),
    ("cumulative_logprob", "TYPE_FP32", [-1]),
    ("logprobs", "TYPE_STRING", [-1]),
    ("num_input_tokens", "TYPE_UINT32", [1]),
    ("num_output_tokens", "TYPE_UINT32", [-1]),
]

# vLLM's SamplingParams fields (plus the backend's lora_name): the stock backend passes every
# key as a keyword, so any other key makes its parsing fail.
_SAMPLING_FIELDS = frozenset({
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "bad_words",
    "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens", "logits_processors",
    "include_stop_str_in_output", "truncate_prompt_tokens", "output_kind",
    "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args", "lora_name",
})


class _SamplingParams:
    def __init__(self, values: dict[str, Any]) -> None:
        self.lora_name: str | None = values.get("lora_name")
        self.temperature = float(values.get("temperature", 1.0))
        max_tokens = values.get("max_tokens", 16)
        self.max_tokens = 16 if max_tokens is None else int(max_tokens)

    @staticmethod
    def from_dict(text: str) -> _SamplingParams | None:
        # Like the stock TritonSamplingParams.from_dict: any problem is logged and None returned.
        try:
            values = json.loads(text)
            unknown = set(values) - _SAMPLING_FIELDS
            if unknown:
                raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
            return _SamplingParams(values)
        except Exception as exc:
            pb_utils.Logger.log_error(
                f"[vllm] Was trying to create `TritonSamplingParams`, but got exception: {exc}"
            )
            return None


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, config: Any) -> Any:
        present = config.as_dict()
        inputs = {entry["name"] for entry in present["input"]}
        outputs = {entry["name"] for entry in present["output"]}
        for name, data_type, dims, optional in _INPUTS:
            if name not in inputs:
                entry = {"name": name, "data_type": data_type, "dims": dims}
                if optional:
                    entry["optional"] = True
                config.add_input(entry)
        for name, data_type, dims in _OUTPUTS:
            if name not in outputs:
                config.add_output({"name": name, "data_type": data_type, "dims": dims})
        config.set_model_transaction_policy({"decoupled": True})
        config.set_max_batch_size(0)
        return config

    def initialize(self, args: dict[str, str]) -> None:
        self._model_config = json.loads(args["model_config"])
        output_config = pb_utils.get_output_config_by_name(self._model_config, "text_output")
        self._output_dtype = pb_utils.triton_string_to_numpy(output_config["data_type"])
        assert pb_utils.using_decoupled_model_transaction_policy(self._model_config), (
            "vLLM Triton backend must be configured to use decoupled model transaction policy"
        )
        fail_flag = os.environ.get(_FAIL_FLAG_ENV)
        if fail_flag and Path(fail_flag).exists():
            raise RuntimeError("CUDA out of memory (simulated by the stand-in)")
        parameters = self._model_config.get("parameters", {})
        health = parameters.get("ENABLE_VLLM_HEALTH_CHECK", {}).get("string_value", "false")
        self._enable_health_check = health.strip().lower() in ("true", "yes", "1")
        self._dead: str | None = None  # why the engine died, once it has
        load_delay_s = float(os.environ.get(_LOAD_DELAY_ENV, "0") or 0)
        if load_delay_s:
            time.sleep(load_delay_s)  # a slow engine load: time passing is the point
        model_dir = Path(pb_utils.get_model_dir())
        engine_args_path = model_dir / _ENGINE_ARGS_FILENAME
        assert engine_args_path.is_file(), (
            f"'{_ENGINE_ARGS_FILENAME}' containing vllm engine args must be provided in "
            f"'{model_dir}'"
        )
        self._engine_args = json.loads(engine_args_path.read_text())
        self._enable_lora = str(self._engine_args.get("enable_lora", "")).lower() == "true"
        self._lora_repository: dict[str, str] = {}
        if self._enable_lora:
            # Read once, at load: the reason the catalog needs a model reload to change.
            try:
                with open(model_dir / _MULTI_LORA_FILENAME) as lora_file:
                    self._lora_repository = json.load(lora_file)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"Triton backend cannot find {model_dir / _MULTI_LORA_FILENAME}."
                ) from None
        self._supported_loras = list(self._lora_repository)
        # vLLM keeps up to max_cpu_loras loaded adapters by name and never re-reads one it holds.
        self._max_cpu_loras = int(self._engine_args.get("max_cpu_loras",
                                                        self._engine_args.get("max_loras", 1)))
        self._loaded: OrderedDict[int, str] = OrderedDict()  # int id -> weights digest
        self._loaded_lock = threading.Lock()
        self._delay_s = float(os.environ.get(_DELAY_ENV, "0") or 0)
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="standin-vllm")
        pb_utils.Logger.log_info(
            f"[standin-vllm] loaded with {len(self._supported_loras)} LoRAs: "
            f"{self._supported_loras[:20]}"
        )

    def execute(self, requests: list[Any]) -> None:
        if self._enable_health_check and self._dead is not None:
            # As the stock backend's _check_health: unload (non-blocking), answer UNAVAILABLE.
            pb_utils.Logger.log_error(f"[vllm] Engine is not healthy and model will be "
                                      f"unloaded: {self._dead}")
            pb_utils.unload_model(self._model_config["name"])
            for request in requests:
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        message="Model is unavailable due to unhealthy vLLM engine",
                        code=pb_utils.TritonError.UNAVAILABLE)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
            return None
        for request in requests:
            if self._verify_lora(request):
                self._pool.submit(self._infer, request)
        return None

    def _verify_lora(self, request: Any) -> bool:
        tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
        parameters = tensor.as_numpy()[0].decode("utf-8") if tensor else request.parameters()
        lora_name = json.loads(parameters).pop("lora_name", None)
        error = None
        if lora_name is not None:
            if not self._enable_lora:
                error = pb_utils.TritonError("LoRA feature is not enabled.")
            elif lora_name not in self._supported_loras:
                error = pb_utils.TritonError(
                    f"LoRA {lora_name} is not supported, we currently support "
                    f"{self._supported_loras}"
                )
        if error is None:
            return True
        output = pb_utils.Tensor("text_output",
                                 np.asarray([error.message()], dtype=self._output_dtype))
        request.get_response_sender().send(
            pb_utils.InferenceResponse(output_tensors=[output], error=error),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )
        return False

    def _infer(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            self._generate(request, sender)
        except Exception as exc:
            output = pb_utils.Tensor("text_output", np.asarray(["N/A"], dtype=self._output_dtype))
            sender.send(
                pb_utils.InferenceResponse(
                    output_tensors=[output],
                    error=pb_utils.TritonError(f"Error generating stream: {exc}"),
                ),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    def _generate(self, request: Any, sender: Any) -> None:
        if self._dead is not None:  # a dead engine fails every request, with or without LoRA
            raise RuntimeError(f"EngineCore encountered an issue. ({self._dead})")
        prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        stream_tensor = pb_utils.get_input_tensor_by_name(request, "stream")
        stream = bool(stream_tensor.as_numpy()[0]) if stream_tensor else False
        exclude = pb_utils.get_input_tensor_by_name(request, "exclude_input_in_output")
        if exclude:
            prepend_input = not bool(exclude.as_numpy()[0])
        else:
            prepend_input = not stream
        if prepend_input and stream:
            raise ValueError("When streaming, `exclude_input_in_output` = False is not allowed.")
        tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
        parameters = tensor.as_numpy()[0].decode("utf-8") if tensor else request.parameters()
        sampling = _SamplingParams.from_dict(parameters)
        lora_name = sampling.lora_name  # None from a bad dict fails here, as in the stock backend
        digest = self._adapter_digest(lora_name) if lora_name is not None else None
        if self._delay_s:
            time.sleep(self._delay_s)  # an engine's time to generate: time passing is the point
        words = answer_words(digest, prompt, sampling.temperature)
        words = words[: max(sampling.max_tokens, 0)]
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if stream:
            for index, word in enumerate(words):
                piece = word if index == 0 else " " + word
                sender.send(self._response(piece), flags=final if index == len(words) - 1 else 0)
            if not words:
                sender.send(self._response(""), flags=final)
            return
        text = (prompt if prepend_input else "") + " ".join(words)
        sender.send(self._response(text), flags=final)

    def _adapter_digest(self, lora_name: str) -> str:
        # The stock backend's LoRARequest(str(i), i, path): i is the name's position + 1, and
        # vLLM caches what it read under i.
        int_id = self._supported_loras.index(lora_name) + 1
        with self._loaded_lock:
            if self._dead is not None:
                raise RuntimeError(f"EngineCore encountered an issue. ({self._dead})")
            digest = self._loaded.get(int_id)
            if digest is not None:
                self._loaded.move_to_end(int_id)
                return digest
        path = Path(self._lora_repository[lora_name])
        reads = os.environ.get(_READS_ENV)
        if reads:
            with open(reads, "a", encoding="utf-8") as log:
                log.write(f"{int_id} {lora_name} {path}\n")
        try:
            digest = load_adapter(path)
        except (OSError, ValueError) as exc:
            # In vLLM the engine core process fails the whole batch and exits.
            with self._loaded_lock:
                self._dead = f"Loading lora {int_id} failed: {exc}"
            raise RuntimeError(f"EngineCore encountered an issue. ({self._dead})") from exc
        pb_utils.Logger.log_info(f"[standin-vllm] loaded LoRA {lora_name} from {path}: {digest}")
        with self._loaded_lock:
            self._loaded[int_id] = digest
            while len(self._loaded) > self._max_cpu_loras:
                self._loaded.popitem(last=False)
        return digest

    def _response(self, text: str) -> Any:
        output = pb_utils.Tensor("text_output",
                                 np.asarray([text.encode("utf-8")], dtype=self._output_dtype))
        return pb_utils.InferenceResponse(output_tensors=[output])

    def finalize(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
