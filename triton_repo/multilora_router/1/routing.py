"""The router, per request: read it, ask the sidecar for the adapter, call the engine with the
name it gave, pass the answer on, release the lease. The sidecar decides the rest: it holds a
request no engine serves yet, judges an engine's refusal (told in the next /stage), and its
errors say the Triton status and message a client sees. Standard library only."""

from __future__ import annotations

import http.client
import json
import math
import re
import select
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


class RouteError(Exception):
    """What a client sees: the Triton status (a pb_utils.TritonError code's name), the message."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


DEFAULT_SAMPLING = {"temperature": 0, "max_tokens": 256}
# The stock backend makes each key of `sampling_parameters` a keyword of vLLM's SamplingParams;
# one it does not know fails with an opaque "'NoneType' object has no attribute 'lora_name'". So
# only these pass, with the JSON types vLLM takes (no `n`/`best_of`: one generated_text).
SAMPLING_KEYS: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"), (int, float)),
    **dict.fromkeys(("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                     "truncate_prompt_tokens"), (int,)),
    **dict.fromkeys(("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"), (bool,)),
    **dict.fromkeys(("stop_token_ids", "bad_words", "allowed_token_ids"), (list,)),
    "stop": (str, list), "logit_bias": (dict,), "structured_outputs": (str,),
}


def requested_adapter_id(input_value: str | None, parameters_json: str | None,
                         header: str = "x-adapter-id") -> str:
    """The `header` Triton forwarded as a request parameter (what a routing proxy hashed on;
    Triton keeps an HTTP header's spelling), else the `adapter_id` input. Both, naming different
    adapters, is refused: the proxy would have sent the request to the other adapter's node."""
    parameters = json.loads(parameters_json or "{}")  # Triton's own JSON object
    values = [v for k, v in parameters.items() if k.lower() == header]
    if len(values) > 1 or (values and not isinstance(values[0], str)):
        raise RouteError("INVALID_ARG", f"the {header} header must be given once, as a string")
    from_header = values[0].strip() if values else None
    if from_header is not None and (input_value or "").strip() and from_header != input_value:
        raise RouteError("INVALID_ARG", f"the {header} header ({from_header!r}) and the "
                         f"adapter_id input ({input_value!r}) name different adapters; send one, "
                         "or the same in both")
    adapter_id = from_header if from_header is not None else input_value
    if adapter_id is None:
        raise RouteError("INVALID_ARG", f"send the {header} header or the adapter_id input")
    return adapter_id


def sampling_parameters(text: str | None, lora_name: str) -> str:
    """The caller's JSON merged over the defaults, with `lora_name`; the JSON for vllm_model."""
    try:
        given: Any = json.loads(text) if text and text.strip() else {}
    except ValueError as exc:
        raise RouteError("INVALID_ARG", f"sampling_parameters is not valid JSON: {exc}") from exc
    if not isinstance(given, dict):
        raise RouteError("INVALID_ARG", "sampling_parameters must be a JSON object")
    problems = []
    for key, value in given.items():
        types = SAMPLING_KEYS.get(key, ())
        named = " or ".join(t.__name__ for t in types)  # int or float, str or list, ...
        if key == "lora_name":
            problems.append("lora_name is set by the router from adapter_id")
        elif not types:
            problems.append(f"unknown key {key!r}")
        elif isinstance(value, bool) and bool not in types:
            problems.append(f"{key} must be {named}, not a boolean")
        elif not isinstance(value, types):
            problems.append(f"{key} must be {named}")
    if problems:
        raise RouteError("INVALID_ARG", "sampling_parameters refused: " + "; ".join(problems)
                         + f" (accepted keys: {', '.join(sorted(SAMPLING_KEYS))})")
    return json.dumps({**DEFAULT_SAMPLING, **given, "lora_name": lora_name})


PROVENANCE = ("content_digest", "signer", "signer_identity")
_SECONDS = (lambda s: 0 < s < math.inf, "a number of seconds greater than 0")
_RULES: Mapping[str, tuple[Callable[[Any], Any], str]] = {  # each parameter's, in a problem
    "sidecar_url": (lambda u: u.startswith(("http://", "https://")), "http://host:port"),
    "stage_timeout_s": _SECONDS, "sidecar_timeout_s": _SECONDS,
    "hold_s": (lambda s: 0 <= s < math.inf, "a number of seconds 0 or more"),
    "vllm_model": (bool, "the name of the vLLM model"),
    "adapter_id_header": (re.compile(r"[a-z0-9][a-z0-9-]{0,63}").fullmatch, "a lower-case "
                          "header name such as x-adapter-id (gRPC metadata keys are lower-case)"),
    "max_concurrent_requests": (lambda n: 1 <= n <= 4096, "a whole number from 1 to 4096")}
_ENVIRONMENT = {"LORA_SIDECAR_URL": "sidecar_url",  # and LORA_SIDECAR_API_TOKEN itself
                "LORA_SIDECAR_API_TOKEN_FILE": "sidecar_api_token_file"}


@dataclass(frozen=True, slots=True)
class RouterSettings:  # the router model's config.pbtxt parameters
    sidecar_url: str = "http://127.0.0.1:8500"
    stage_timeout_s: float = 300.0  # the longest the sidecar takes for an adapter (a download)
    sidecar_timeout_s: float = 5.0  # connect and answer on /release; slack on /stage
    hold_s: float = 180.0  # the longest the sidecar holds a request no engine serves yet
    vllm_model: str = "vllm_model"
    adapter_id_header: str = "x-adapter-id"
    max_concurrent_requests: int = 128
    api_token: str | None = None

    @classmethod
    def from_deployment(cls, parameters: Mapping[str, str],
                        env: Mapping[str, str]) -> RouterSettings:
        """config.pbtxt's `parameters`, then the container's variables; ValueError lists all."""
        given = {**parameters, **{key: env[variable] for variable, key in _ENVIRONMENT.items()
                                  if env.get(variable, "").strip()}}
        values: dict[str, Any] = {}
        problems = []
        for field in fields(cls)[:-1]:
            raw = given.get(field.name, str(field.default)).strip().rstrip("/")
            try:
                values[field.name] = type(field.default)(
                    raw.lower() if field.name == "adapter_id_header" else raw)
            except ValueError:
                values[field.name] = None
            if values[field.name] is None or not _RULES[field.name][0](values[field.name]):
                problems.append(f"{field.name} {raw!r}: must be {_RULES[field.name][1]}")
        token = env.get("LORA_SIDECAR_API_TOKEN", "").strip() or None
        token_file = given.get("sidecar_api_token_file", "").strip()
        if token is None and token_file:
            try:
                token = Path(token_file).read_text(encoding="utf-8").strip() or None
            except OSError as exc:
                problems.append(f"sidecar_api_token_file {token_file}: {exc.strerror}")
        if problems:
            raise ValueError("multilora_router parameters: " + "; ".join(problems))
        return cls(**values, api_token=token)


class VllmError(Exception):
    """vllm_model answered with an error; `code` is the Triton error code's name if known."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code = message, code


@dataclass(frozen=True, slots=True)
class Lease:  # the sidecar's /stage answer: vllm_model's name for it, which bytes (PROVENANCE)
    adapter_id: str
    lease_id: str
    lora_name: str
    content_digest: str | None = None
    signer: str | None = None
    signer_identity: str | None = None


def provenance(lease: Lease) -> dict[str, str]:
    return {name: getattr(lease, name) or "" for name in PROVENANCE}


def provenance_line(request_id: str, lease: Lease) -> str:
    return (f"multilora_router answered request_id={request_id or '-'} adapter_id="
            f"{lease.adapter_id} lora_name={lease.lora_name} " + " ".join(
                f"{key}={value or '-'}" for key, value in provenance(lease).items()))


class SidecarClient:
    """POST /stage and /release over one keep-alive connection per thread. Plain http.client,
    never urllib: a call never goes through a proxy named by http_proxy/HTTP_PROXY."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        url = urllib.parse.urlsplit(settings.sidecar_url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._connect = lambda: kind(url.hostname or "127.0.0.1", url.port)
        self._headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {})
        self._local = threading.local()
        self._opened: list[http.client.HTTPConnection] = []  # for close()

    def stage(self, adapter_id: str, hold_s: float = 0.0,
              refused: Mapping[str, Any] | None = None) -> Lease:
        """A lease; `refused` reports the engine's refusal of the last one's name."""
        timeout_s = self.settings.stage_timeout_s
        answer = self._post("/stage", {"adapter_id": adapter_id, "timeout_s": timeout_s,
                                       "hold_s": hold_s, "engine_refused": refused},
                            timeout_s + self.settings.sidecar_timeout_s)  # its own ends first
        return Lease(**{f.name: answer[f.name] for f in fields(Lease) if f.name in answer})

    def release(self, lease: Lease, warn: Callable[[str], None]) -> None:
        """A failed release only warns: the lease expires on its own (--lease-ttl)."""
        try:
            self._post("/release", {"lease_id": lease.lease_id}, self.settings.sidecar_timeout_s)
        except RouteError as exc:
            warn(f"could not release lease {lease.lease_id} of {lease.adapter_id}: {exc.message}")

    def close(self) -> None:
        for connection in list(self._opened):
            connection.close()

    def _post(self, path: str, payload: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = self._connect()
            self._opened.append(connection)
        if connection.sock is not None and select.select([connection.sock], [], [], 0)[0]:
            connection.close()  # readable while idle: the sidecar closed it; open a fresh one
        connection.timeout = timeout_s
        if connection.sock is not None:
            connection.sock.settimeout(timeout_s)
        try:
            connection.request("POST", path, json.dumps(payload).encode(), self._headers)
            response = connection.getresponse()
            raw = response.read(1024 * 1024)  # at most: the rest is closed
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise RouteError("UNAVAILABLE", f"sidecar unreachable at {self.settings.sidecar_url}"
                             f" ({path}): {exc!r}; check that lora-sidecar is running and the "
                             "router's sidecar_url") from exc
        if response.will_close or not response.isclosed():
            connection.close()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = raw[:200]
        if not isinstance(answer, dict):
            raise RouteError("INTERNAL", f"the sidecar answered no JSON object: {answer!r}")
        if response.status >= 400:  # the sidecar's answer says what the client should see
            raise RouteError(str(answer.get("triton_status", "INTERNAL")),
                             str(answer.get("triton_message") or answer.get("message")))
        return answer


def route(prompt: str, adapter_id: str, sampling_json: str | None, sidecar: SidecarClient,
          generate: Callable[[str, str], Iterable[str]],
          warn: Callable[[str], None] = lambda message: None,
          on_lease: Callable[[Lease], None] = lambda lease: None) -> str:
    """Generated text, or RouteError. `generate(prompt, sampling_json)` yields text (a BLS call)
    or raises VllmError, which the next /stage reports; `on_lease` hears each lease."""
    sampling_parameters(sampling_json, adapter_id)  # refused before anything is staged
    hold_until = time.monotonic() + sidecar.settings.hold_s
    refused = None
    while True:
        lease = sidecar.stage(adapter_id, max(hold_until - time.monotonic(), 0.0), refused)
        on_lease(lease)
        try:
            return "".join(generate(prompt, sampling_parameters(sampling_json, lease.lora_name)))
        except VllmError as exc:
            refused = {"lora_name": lease.lora_name, "message": exc.message, "code": exc.code}
        finally:
            sidecar.release(lease, warn)
