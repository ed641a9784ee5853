"""What a request asks for: the adapter (the header a routing proxy hashed on, or the input)
and the sampling parameters, checked before anything is staged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from router_errors import RouteError, Status

DEFAULT_SAMPLING: Mapping[str, Any] = {"temperature": 0, "max_tokens": 256}

# The stock backend turns every key of `sampling_parameters` into a keyword of vLLM's
# SamplingParams; one it does not know fails the request with an opaque "'NoneType' object has
# no attribute 'lora_name'". So the router accepts only these, each with the JSON types vLLM
# takes. `n`/`best_of` are left out: the router answers one generated_text.
_NUMBER = (int, float)
SAMPLING_KEYS: Mapping[str, tuple[type, ...]] = {
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": (int,),
    "min_p": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "repetition_penalty": _NUMBER,
    "seed": (int,),
    "max_tokens": (int,),
    "min_tokens": (int,),
    "stop": (str, list),
    "stop_token_ids": (list,),
    "bad_words": (list,),
    "ignore_eos": (bool,),
    "include_stop_str_in_output": (bool,),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "logprobs": (int,),
    "prompt_logprobs": (int,),
    "truncate_prompt_tokens": (int,),
    "logit_bias": (dict,),
    "allowed_token_ids": (list,),
    "structured_outputs": (str,),
}


def requested_adapter_id(input_value: str | None, parameters_json: str | None,
                         header: str = "x-adapter-id") -> str:
    """The adapter a request asks for: the `header` Triton forwarded as a request parameter
    (what a routing proxy hashed on), else the `adapter_id` input. Both given and different is
    refused: the proxy would have sent the request to the node of the other adapter."""
    from_header = _header_parameter(parameters_json, header)
    given_input = input_value if input_value is not None and input_value.strip() else None
    if from_header is not None and given_input is not None and from_header != given_input:
        raise RouteError(
            Status.INVALID_ARG,
            f"the {header} header ({from_header!r}) and the adapter_id input "
            f"({given_input!r}) name different adapters; send one, or the same in both",
        )
    adapter_id = from_header if from_header is not None else input_value
    if adapter_id is None:
        raise RouteError(Status.INVALID_ARG,
                         f"no adapter named: send the {header} header or the adapter_id input")
    return adapter_id


def _header_parameter(parameters_json: str | None, header: str) -> str | None:
    """The forwarded header's value among the request's parameters. Triton keeps an HTTP
    header's spelling (X-Adapter-Id), so names are compared without case."""
    if not parameters_json:
        return None
    try:
        parameters = json.loads(parameters_json)
    except ValueError:
        return None
    if not isinstance(parameters, dict):
        return None
    values = [v for k, v in parameters.items() if isinstance(k, str) and k.lower() == header]
    if not values:
        return None
    if len(values) > 1 or not isinstance(values[0], str):
        raise RouteError(Status.INVALID_ARG,
                         f"the {header} header must be given once, as a string")
    value: str = values[0].strip()
    return value


def sampling_parameters(text: str | None, adapter_id: str) -> str:
    """The caller's JSON merged over the defaults, with `lora_name`; the JSON for vllm_model."""
    given: Any = {}
    if text is not None and text.strip():
        try:
            given = json.loads(text)
        except ValueError as exc:
            raise RouteError(Status.INVALID_ARG,
                             f"sampling_parameters is not valid JSON: {exc}") from exc
    if not isinstance(given, dict):
        raise RouteError(Status.INVALID_ARG, "sampling_parameters must be a JSON object")
    problems = []
    for key, value in given.items():
        if key == "lora_name":
            problems.append("lora_name is set by the router from adapter_id")
        elif key not in SAMPLING_KEYS:
            problems.append(f"unknown key {key!r}")
        elif isinstance(value, bool) and bool not in SAMPLING_KEYS[key]:
            problems.append(f"{key} must be {_type_names(SAMPLING_KEYS[key])}, not a boolean")
        elif not isinstance(value, SAMPLING_KEYS[key]):
            problems.append(f"{key} must be {_type_names(SAMPLING_KEYS[key])}")
    if problems:
        raise RouteError(
            Status.INVALID_ARG,
            "sampling_parameters refused: " + "; ".join(problems)
            + f" (accepted keys: {', '.join(sorted(SAMPLING_KEYS))})",
        )
    return json.dumps({**DEFAULT_SAMPLING, **given, "lora_name": adapter_id})


def _type_names(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", bool: "true or false"}
    if types == _NUMBER:
        return "a number"
    return " or ".join(names[t] for t in types)
