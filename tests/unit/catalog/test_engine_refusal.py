"""catalog/engine_refusal.py: the engine's refusal of a name, as the router reports it, judged:
what a reload or a restart will end is waited out, a failure of the request itself is not."""

from __future__ import annotations

import pytest

from sidecar.catalog.engine_refusal import EngineRefusal, judge
from sidecar.core.errors import BadRequest, EngineFailed, EngineUnavailable


@pytest.mark.parametrize(("message", "code", "says"), [
    ("LoRA late-v1 is not supported, we currently support ['a1']", None,
     "has not loaded a catalog that lists adapter late-v1"),
    ("EngineCore encountered an issue. See stack trace", "INTERNAL", "engine is down"),
    ("Request for unknown model: 'vllm_model' is not found", "NOT_FOUND", "is not available"),
    ("model 'vllm_model' is not ready", None, "is not available"),
])
def test_what_a_reload_or_restart_ends_is_unavailable(message: str, code: str | None,
                                                       says: str) -> None:
    error = judge(EngineRefusal("late-v1", message, code), "late-v1", "vllm_model")

    assert isinstance(error, EngineUnavailable)
    assert says in error.message and message[:40] in error.message
    assert error.to_json()["triton_status"] == "UNAVAILABLE"


def test_a_failure_of_the_request_itself_is_answered_as_it_is() -> None:
    error = judge(EngineRefusal("a1", "x" * 1000, "INTERNAL"), "a1", "vllm_model")

    assert isinstance(error, EngineFailed)
    assert error.to_json()["triton_status"] == "INTERNAL"
    assert error.message.endswith("x" * 300 + "...")  # the engine's message, bounded


@pytest.mark.parametrize("body", [
    "LoRA x", {"lora_name": "a1"}, {"lora_name": "a1", "message": 3},
    {"lora_name": "a1", "message": "m", "code": 1}, {"lora_name": "a1", "message": "m", "x": 1},
])
def test_a_malformed_report_is_a_bad_request(body: object) -> None:
    with pytest.raises(BadRequest):
        EngineRefusal.from_json(body)


def test_a_report_reads_back_as_sent() -> None:
    assert EngineRefusal.from_json({"lora_name": "a1", "message": "m", "code": None}) == (
        EngineRefusal("a1", "m", None))
