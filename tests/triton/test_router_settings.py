"""routing.py's settings: the router's config.pbtxt parameters and the container's overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.triton.harness import ROUTER, TRITON_REPO, import_router

RouterSettings = import_router().RouterSettings
requested_adapter_id = import_router().requested_adapter_id


def from_parameters(parameters: dict[str, str]) -> object:
    return RouterSettings.from_deployment(parameters, {})


def test_settings_default_to_the_checked_in_config() -> None:
    config = (TRITON_REPO / ROUTER / "config.pbtxt").read_text()
    settings = from_parameters({})

    for key, value in (("sidecar_url", settings.sidecar_url),
                       ("stage_timeout_s", f"{settings.stage_timeout_s:g}"),
                       ("sidecar_timeout_s", f"{settings.sidecar_timeout_s:g}"),
                       ("hold_s", f"{settings.hold_s:g}"),
                       ("vllm_model", settings.vllm_model)):
        assert f'key: "{key}"\n  value: {{ string_value: "{value}" }}' in config


def test_settings_gather_every_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as caught:
        from_parameters({
            "sidecar_url": "localhost:8500", "stage_timeout_s": "soon",
            "sidecar_timeout_s": "-1", "sidecar_api_token_file": str(tmp_path / "missing"),
        })

    message = str(caught.value)
    for part in ("sidecar_url", "stage_timeout_s", "sidecar_timeout_s", "sidecar_api_token_file"):
        assert part in message


def test_the_containers_environment_overrides_the_parameters(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    parameters = {"sidecar_url": "http://127.0.0.1:8500", "stage_timeout_s": "30"}

    plain = RouterSettings.from_deployment(parameters, {"LORA_SIDECAR_URL": " "})
    from_file = RouterSettings.from_deployment(parameters, {
        "LORA_SIDECAR_URL": "http://sidecar:8500",
        "LORA_SIDECAR_API_TOKEN_FILE": str(token_file),
    })
    from_env = RouterSettings.from_deployment(parameters, {
        "LORA_SIDECAR_API_TOKEN_FILE": str(token_file), "LORA_SIDECAR_API_TOKEN": "direct",
    })

    assert (plain.sidecar_url, plain.api_token) == ("http://127.0.0.1:8500", None)
    assert (from_file.sidecar_url, from_file.api_token) == ("http://sidecar:8500", "from-file")
    assert from_file.stage_timeout_s == 30
    assert from_env.api_token == "direct"


def test_the_header_name_is_a_parameter() -> None:
    settings = from_parameters({"adapter_id_header": "X-Tenant-Adapter"})

    assert settings.adapter_id_header == "x-tenant-adapter"
    assert requested_adapter_id(None, '{"x-tenant-adapter": "t1"}',
                                settings.adapter_id_header) == "t1"
    with pytest.raises(ValueError, match="adapter_id_header"):
        from_parameters({"adapter_id_header": "bad header"})
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        from_parameters({"max_concurrent_requests": "0"})
