"""The engine's limits come from its own model.json (--engine-config): `serve` and `validate`
take max_lora_rank and the base model's folder from it, and a --max-lora-rank that disagrees
stops the start naming both values, the flag, its variable and the file."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sidecar.config import Settings
from sidecar.core.errors import ConfigError
from sidecar.process.examples import write_adapter
from sidecar.validation.shapes import TINY_LLAMA
from tests.support.paths import REPO

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("LORA_SIDECAR_")}


def model_json(folder: Path, **keys: Any) -> Path:
    """A vllm_model/1/model.json as Triton's vLLM backend reads it."""
    config = {"model": "/models/base", "enable_lora": True, "max_loras": 4,
              "max_lora_rank": 16, "max_cpu_loras": 8, **keys}
    path = folder / "model.json"
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


def sidecar(*args: str, **variables: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True,
                          text=True, timeout=60, env={**CLEAN_ENV, **variables})


def test_a_max_lora_rank_that_disagrees_with_the_engine_stops_the_start(tmp_path: Path) -> None:
    engine = model_json(tmp_path, max_lora_rank=16)
    (tmp_path / "registry").mkdir()
    cache = tmp_path / "cache"
    by_flag = sidecar("serve", "--engine-config", str(engine), "--max-lora-rank", "32",
                      "--registry", str(tmp_path / "registry"), "--cache-root", str(cache))
    by_variable = sidecar("serve", "--registry", str(tmp_path / "registry"), "--cache-root",
                          str(cache), LORA_SIDECAR_ENGINE_CONFIG=str(engine),
                          LORA_SIDECAR_MAX_LORA_RANK="32")
    for result in (by_flag, by_variable):
        assert result.returncode == 2, result.stderr
        for fragment in ("--max-lora-rank (LORA_SIDECAR_MAX_LORA_RANK) = 32",
                         f"max_lora_rank 16 in {engine}", "--engine-config",
                         "LORA_SIDECAR_ENGINE_CONFIG"):
            assert fragment in result.stderr, result.stderr
    assert not cache.exists()  # nothing was created


def test_the_rank_is_the_engines_when_not_given_or_when_it_agrees(tmp_path: Path) -> None:
    engine = model_json(tmp_path, max_lora_rank=64, max_loras=8, max_cpu_loras=None)
    absent = Settings.from_values({"engine_config": str(engine)})
    agreeing = Settings.from_values({"engine_config": str(engine), "max_lora_rank": "64"})
    assert absent.max_lora_rank == agreeing.max_lora_rank == 64
    assert absent.engine_config is not None
    # vLLM's own defaults where the file leaves a key out: max_cpu_loras is max_loras
    assert (absent.engine_config.max_loras, absent.engine_config.max_cpu_loras) == (8, 8)
    assert Settings.from_values({}).max_lora_rank == 16  # no file: the option's own default


@pytest.mark.parametrize(("keys", "fragment"), [
    ({"enable_lora": False}, '"enable_lora": true'),
    ({"max_lora_rank": 0}, "max_lora_rank must be a whole number of at least 1"),
    ({"max_lora_rank": "16"}, "max_lora_rank must be a whole number"),
    ({"max_loras": 8, "max_cpu_loras": 4}, "max_cpu_loras 4 is less than max_loras 8"),
    ({"model": None}, '"model" must name the base model'),
])
def test_an_engine_config_the_engine_would_refuse_is_named(
    tmp_path: Path, keys: dict[str, Any], fragment: str
) -> None:
    engine = model_json(tmp_path, **keys)
    with pytest.raises(ConfigError) as raised:
        Settings.from_values({"engine_config": str(engine)})
    message = raised.value.message
    assert "--engine-config (LORA_SIDECAR_ENGINE_CONFIG)" in message and fragment in message


def test_not_json_and_no_such_file_are_named(tmp_path: Path) -> None:
    broken = tmp_path / "model.json"
    broken.write_text("{model: base}")
    for path, fragment in ((broken, "is not JSON"), (tmp_path / "absent.json", "no such file")):
        with pytest.raises(ConfigError) as raised:
            Settings.from_values({"engine_config": str(path)})
        assert fragment in raised.value.message


def test_validate_judges_by_the_engines_rank_and_refuses_a_disagreeing_flag(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "rank-32-v1"
    write_adapter(folder, rank=32)
    (tmp_path / "low").mkdir()
    (tmp_path / "high").mkdir()
    low = model_json(tmp_path / "low", max_lora_rank=16)
    high = model_json(tmp_path / "high", max_lora_rank=32)

    refused = sidecar("validate", str(folder), "--engine-config", str(low))
    assert refused.returncode == 1 and "rank_too_large" in refused.stdout, refused.stdout
    assert "max_lora_rank in vllm_model's model.json" in refused.stdout
    served = sidecar("validate", str(folder), LORA_SIDECAR_ENGINE_CONFIG=str(high))
    assert served.returncode == 0, served.stdout + served.stderr
    disagreeing = sidecar("validate", str(folder), "--engine-config", str(high),
                          "--max-lora-rank", "16")
    assert disagreeing.returncode == 2
    assert "--max-lora-rank (LORA_SIDECAR_MAX_LORA_RANK) = 16" in disagreeing.stderr
    assert f"max_lora_rank 32 in {high}" in disagreeing.stderr


def test_the_base_model_folder_the_engine_loads_gives_the_shapes(tmp_path: Path) -> None:
    """model.json's "model" folder, where the sidecar sees it too, is the base model whose
    config.json the tensors are checked against; an explicit --base-model-config wins."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(TINY_LLAMA.to_config()))
    wider = dataclasses.replace(TINY_LLAMA, hidden_size=TINY_LLAMA.hidden_size * 2)
    folder = tmp_path / "wide-v1"
    write_adapter(folder, shapes=wider)
    engine = model_json(tmp_path, model=str(base))

    result = sidecar("validate", str(folder), "--engine-config", str(engine))
    assert result.returncode == 1 and "base_shape_mismatch" in result.stdout, result.stdout
    (tmp_path / "wide.json").write_text(json.dumps(wider.to_config()))
    explicit = sidecar("validate", str(folder), "--engine-config", str(engine),
                       "--base-model-config", str(tmp_path / "wide.json"))
    assert explicit.returncode == 0, explicit.stdout + explicit.stderr


def test_the_checked_in_engine_configs_are_read_as_the_engine_reads_them() -> None:
    for path in (REPO / "triton_repo" / "vllm_model" / "1" / "model.json",
                 REPO / "compose" / "triton-cpu" / "model.json"):
        engine = json.loads(path.read_text())
        settings = Settings.from_values({"engine_config": str(path)})
        assert settings.engine_config is not None
        assert settings.max_lora_rank == engine["max_lora_rank"]
        assert settings.engine_config.max_loras == engine["max_loras"]
        assert settings.engine_config.max_cpu_loras == engine["max_cpu_loras"]


def test_the_seeded_repository_gives_the_engine_config_when_none_is_named(
    tmp_path: Path,
) -> None:
    """With --seed-model-repository (Kubernetes: the image's triton_repo), the vLLM model's
    model.json in it is the engine's file: its rank is taken, a disagreeing one refused."""
    template = tmp_path / "triton_repo"
    (template / "vllm_model" / "1").mkdir(parents=True)
    model_json(template / "vllm_model" / "1", max_lora_rank=64)
    seeded = Settings.from_values({"seed_model_repository": str(template)})
    assert seeded.engine_config is not None and seeded.max_lora_rank == 64
    with pytest.raises(ConfigError) as raised:
        Settings.from_values({"seed_model_repository": str(template), "max_lora_rank": "16"})
    assert "max_lora_rank 64 in" in raised.value.message
    named = model_json(tmp_path, max_lora_rank=32)  # a file named explicitly wins
    both = Settings.from_values({"seed_model_repository": str(template),
                                 "engine_config": str(named)})
    assert both.max_lora_rank == 32
    assert Settings.from_values({"seed_model_repository": str(tmp_path / "empty")}
                                ).engine_config is None  # no such file there: none
