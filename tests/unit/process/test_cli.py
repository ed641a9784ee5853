"""The command line: `serve` options and their errors, and the client commands against a real
running sidecar."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from sidecar.config import OPTIONS, Settings
from sidecar.core.errors import ConfigError
from sidecar.core.units import format_size, parse_size
from sidecar.process.app import Sidecar
from tests.support.api import StartSidecar, call
from tests.support.broken_adapters import edit_config
from tests.support.settings import local_registry_adapter, make_settings


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", *args,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def test_serve_help_documents_every_option_and_its_environment_variable() -> None:
    result = subprocess.run([sys.executable, "-m", "sidecar", "serve", "--help"],
                            capture_output=True, text=True, timeout=30,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0
    for option in OPTIONS:
        assert option.flag in result.stdout
        assert option.env_var in result.stdout


def test_serve_help_is_in_sections_and_states_each_default_once() -> None:
    from sidecar.__main__ import SERVE_SECTIONS, build_parser

    sectioned = [name for _, names in SERVE_SECTIONS for name in names]
    assert sorted(sectioned) == sorted(o.field for o in OPTIONS)  # each in exactly one
    serve = next(a for a in build_parser()._subparsers._group_actions  # type: ignore[union-attr]
                 ).choices["serve"]
    groups = {g.title: [a.dest for a in g._group_actions] for g in serve._action_groups}
    for title, names in SERVE_SECTIONS:
        assert groups[title] == list(names)
    for action in serve._actions:
        if action.dest in sectioned:
            assert action.help is not None and action.help.count("default") == 1, action.help
    text = serve.format_help()
    assert "other options" not in text
    for code in ("0  stopped by SIGTERM", "1  the port could not be bound",
                 "2  the configuration cannot work", "3  another lora-sidecar owns the cache"):
        assert f"  {code}" in text


@pytest.mark.parametrize("args", [
    ["serve", "--max-byte", "10GiB"],
    ["stage", "a", "--time", "5"],
    ["validate", ".", "--max-lora", "32"],
    ["examples", "--skip-if", "folder"],
])
def test_a_unique_prefix_of_an_option_is_refused_not_guessed(args: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert f"unrecognized arguments: {args[-2]}" in result.stderr


def test_version_is_the_installed_distribution() -> None:
    from importlib.metadata import version

    result = subprocess.run([sys.executable, "-m", "sidecar", "--version"],
                            capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (0, f"lora-sidecar {version('lora-sidecar')}\n")


def test_bad_configuration_lists_every_problem_at_start(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--port", "99999", "--max-bytes", "lots",
         "--registry", "ftp://x", "--cache-root", str(tmp_path)],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, "LORA_SIDECAR_LEASE_TTL": "-1"},
    )
    assert result.returncode == 2
    for fragment in ("--port", "--max-bytes", "--registry", "--lease-ttl"):
        assert fragment in result.stderr
    assert not (tmp_path / "adapters").exists()


def test_environment_variables_configure_and_flags_override_them() -> None:
    from sidecar.__main__ import build_parser, settings_from

    env = {"LORA_SIDECAR_MAX_ADAPTERS": "7", "LORA_SIDECAR_PORT": "9000"}
    args = build_parser().parse_args(["serve", "--port", "9100"])
    settings = settings_from(args, env)
    assert settings.max_adapters == 7
    assert settings.port == 9100
    assert Settings.from_env(env).port == 9000


def test_settings_errors_hide_the_api_token() -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_values({"api_token": "s3cret-value", "port": "-5"})
    assert "s3cret-value" not in str(caught.value)
    assert "s3cret-value" not in repr(Settings.from_values({"api_token": "s3cret-value"}))


def test_examples_fill_an_empty_registry_once(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    first = subprocess.run([sys.executable, "-m", "sidecar", "examples", str(registry)],
                           capture_output=True, text=True, timeout=60)
    assert first.returncode == 0
    ids = sorted(p.name for p in registry.iterdir())
    assert len(ids) == 2
    before = {p: p.stat().st_mtime_ns for p in registry.rglob("*")}
    second = subprocess.run([sys.executable, "-m", "sidecar", "examples", str(registry)],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 0
    assert {p: p.stat().st_mtime_ns for p in registry.rglob("*")} == before
    for adapter_id in ids:
        checked = subprocess.run(
            [sys.executable, "-m", "sidecar", "validate", str(registry / adapter_id)],
            capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stdout


def test_examples_are_readable_by_other_users(tmp_path: Path) -> None:
    """A registry seeded with `examples` is read by others too: MinIO's user uploading it, a
    container running as another uid. Every file is 0644 under the usual umask, as
    adapter_config.json always was (safetensors writes its file 0600)."""
    registry = tmp_path / "registry"
    result = subprocess.run(["sh", "-c", f'umask 022 && exec "$0" -m sidecar examples {registry}',
                             sys.executable], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    modes = {p.relative_to(registry).as_posix(): oct(p.stat().st_mode & 0o777)
             for p in registry.rglob("*") if p.is_file()}
    assert len(modes) == 4
    assert set(modes.values()) == {"0o644"}, modes


async def test_client_commands_against_a_running_sidecar(
    tmp_path: Path, start_sidecar: StartSidecar
) -> None:
    for i, adapter_id in enumerate(("a", "b")):
        local_registry_adapter(tmp_path, adapter_id, seed=i)
    sidecar: Sidecar = await start_sidecar(make_settings(tmp_path))
    url = ["--url", sidecar.url]

    code, out, err = await run_cli("stage", "a", *url)
    assert code == 0, err
    assert "staged a" in out
    code, out, _ = await run_cli("stage", "a", *url, "--json")
    assert code == 0
    assert json.loads(out)["cached"] is True

    code, out, _ = await run_cli("pin", "b", *url)
    assert code == 0
    code, out, _ = await run_cli("ls", *url, "--json")
    listing = {a["adapter_id"]: a for a in json.loads(out)["adapters"]}
    assert set(listing) == {"a", "b"}
    assert listing["b"]["pinned"] is True
    code, out, _ = await run_cli("ls", *url)
    assert code == 0
    assert "ADAPTER" in out and "b" in out

    code, _, err = await run_cli("evict", "b", *url)
    assert code == 1
    assert "adapter_in_use" in err
    code, _, _ = await run_cli("unpin", "b", *url)
    assert code == 0
    code, out, _ = await run_cli("evict", "b", *url)
    assert code == 0
    assert "evicted b" in out
    assert sidecar.store.get("b") is None

    code, _, err = await run_cli("stage", "../etc", *url)
    assert code == 2
    assert "invalid adapter id" in err


async def test_prewarm_exits_zero_only_when_every_adapter_is_staged(
    tmp_path: Path, start_sidecar: StartSidecar
) -> None:
    for i, adapter_id in enumerate(("a", "b")):
        local_registry_adapter(tmp_path, adapter_id, seed=i)
    sidecar = await start_sidecar(make_settings(tmp_path))

    code, out, err = await run_cli("prewarm", "a", "b", "--url", sidecar.url)
    assert code == 0, err
    assert {a.adapter_id for a in sidecar.store.adapters()} == {"a", "b"}

    code, out, err = await run_cli("prewarm", "a", "missing", "--url", sidecar.url, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["failed"] == ["missing"]
    assert report["results"]["missing"]["error"] == "adapter_not_found"


async def test_a_refused_stage_prints_each_problem_once_and_how_to_clear_the_verdict(
    tmp_path: Path, start_sidecar: StartSidecar
) -> None:
    folder = local_registry_adapter(tmp_path, "bad-v1", rank=32)
    edit_config(folder, use_dora=True)
    sidecar = await start_sidecar(make_settings(tmp_path))

    for attempt in ("first", "remembered"):
        code, _, err = await run_cli("stage", "bad-v1", "--url", sidecar.url)

        assert code == 1, err
        lines = err.splitlines()
        assert lines[0].startswith("error: invalid_adapter: adapter bad-v1 was refused by "
                                   "validation (2 problems")
        assert "`lora-sidecar evict bad-v1` clears it now" in lines[0]
        assert ("remembered verdict" in lines[0]) is (attempt == "remembered")
        for what in ("rank_too_large adapter_config.json",
                     "dora_not_supported adapter_config.json"):
            assert [line.startswith(f"  - {what}: ") for line in lines[1:]].count(True) == 1
        assert err.count("greater than max_lora_rank") == 1, err

    code, _, err = await run_cli("prewarm", "bad-v1", "--url", sidecar.url, "--ready-timeout", "1")
    assert code == 1
    assert err.count("greater than max_lora_rank") == 1, err


async def test_client_commands_report_an_unreachable_sidecar() -> None:
    code, _, err = await run_cli("ls", "--url", "http://127.0.0.1:9")
    assert code == 1
    assert "cannot reach the sidecar" in err


async def test_evict_of_a_leased_adapter_names_the_force_flag(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_sidecar(make_settings(tmp_path))
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a"})
    assert status == 200, body

    code, _, err = await run_cli("evict", "a", "--url", sidecar.url)
    assert code == 1
    assert "held by 1 live lease(s)" in err
    assert "lora-sidecar evict a --force" in err
    assert "force=true" not in err

    code, out, err = await run_cli("evict", "a", "--url", sidecar.url, "--force")
    assert code == 0, err
    assert "broke 1 lease(s)" in out


async def test_a_refused_token_names_the_client_flag(
    tmp_path: Path, start_sidecar: StartSidecar
) -> None:
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_sidecar(make_settings(tmp_path, api_token="right-token"))

    code, _, err = await run_cli("pin", "a", "--url", sidecar.url)
    assert code == 1
    assert "unauthorized" in err
    assert "--token" in err and "LORA_SIDECAR_API_TOKEN" in err
    assert "pass --token TOKEN" in err
    assert "--api-token" not in err  # the sidecar's flag, not this command's

    code, _, err = await run_cli("pin", "a", "--url", sidecar.url, "--token", "wrong-token")
    assert code == 1
    assert "refused the token given (--token" in err

    code, out, err = await run_cli("pin", "a", "--url", sidecar.url,
                                   env={"LORA_SIDECAR_API_TOKEN": "right-token"})
    assert code == 0, err
    assert out.startswith("pinned a")


async def test_unpin_tells_whether_the_adapter_was_pinned(
    tmp_path: Path, start_sidecar: StartSidecar
) -> None:
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_sidecar(make_settings(tmp_path))

    code, out, _ = await run_cli("unpin", "a", "--url", sidecar.url)
    assert code == 0
    assert out.strip() == "a was not pinned; nothing changed"

    code, _, err = await run_cli("pin", "a", "--url", sidecar.url)
    assert code == 0, err
    code, out, _ = await run_cli("unpin", "a", "--url", sidecar.url)
    assert code == 0
    assert out.strip() == "unpinned a"
    assert sidecar.store.is_pinned("a") is False


def test_examples_say_what_they_did_with_a_folder(tmp_path: Path) -> None:
    def examples(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sidecar", "examples", *args],
                              capture_output=True, text=True, timeout=60)

    mine = tmp_path / "mine"
    (mine / "my-adapter").mkdir(parents=True)
    refused = examples(str(mine))
    assert refused.returncode == 1
    assert "is not empty" in refused.stderr and "'my-adapter'" in refused.stderr
    assert "no example was written" in refused.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["my-adapter"]

    skipped = examples(str(mine), "--skip-if-not-empty")
    assert skipped.returncode == 0
    assert "no example was written" in skipped.stdout

    fresh = tmp_path / "fresh"
    written = examples(str(fresh))
    assert written.returncode == 0 and "wrote example adapters" in written.stdout
    again = examples(str(fresh))
    assert again.returncode == 0
    assert "already in" in again.stdout


async def test_sizes_read_back_in_the_units_they_are_given_in(
    tmp_path: Path, start_sidecar: StartSidecar
) -> None:
    local_registry_adapter(tmp_path, "a")
    default_budget = next(o.default for o in OPTIONS if o.field == "max_bytes")
    sidecar = await start_sidecar(make_settings(
        tmp_path, max_bytes=parse_size(default_budget)))
    code, out, err = await run_cli("stage", "a", "--url", sidecar.url)
    assert code == 0, err
    size = sidecar.store.get("a")
    assert size is not None
    assert f"({format_size(size.size_bytes)})" in out and "KiB" in out

    code, out, _ = await run_cli("ls", "--url", sidecar.url)
    assert code == 0
    assert out.rstrip().endswith(f"of {default_budget.replace('GiB', ' GiB')}")
    for option in OPTIONS:
        if option.metavar == "SIZE":  # every size option reads back as it is written
            shown = format_size(parse_size(option.default))
            assert shown.replace(" ", "") == option.default


def test_decimal_size_units_are_refused_naming_the_binary_one(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--max-bytes", "500GB",
         "--min-free-disk", "1G", "--registry", str(tmp_path)],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "write 500GiB" in result.stderr and "write 1GiB" in result.stderr
    with pytest.raises(ValueError):
        parse_size("20GB")
    assert parse_size("20Gi") == parse_size("20GiB") == 20 * 1024**3


def test_sign_then_validate_with_the_policy_accepts_the_folder_and_a_change_is_named(
    tmp_path: Path
) -> None:
    from sidecar.process.examples import write_adapter
    from tests.support.signing_keys import key_policy, make_key, write_sha256sums

    key = make_key(tmp_path / "keys", "acme-2026")
    policy = key_policy(tmp_path, key, match='prefix = "acme-"')
    folder = tmp_path / "acme-support-v1"
    write_adapter(folder)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True,
                              text=True, timeout=60)

    unsigned = cli("validate", str(folder), "--policy", str(policy))
    signed = cli("sign", str(folder), "--key", str(key.private))
    valid = cli("validate", str(folder), "--policy", str(policy), "--json")
    write_sha256sums(folder)
    changed = cli("validate", str(folder), "--policy", str(policy))
    other_id = cli("validate", str(folder), "--policy", str(policy), "--adapter-id", "globex-x")

    assert unsigned.returncode == 1 and "signature_missing" in unsigned.stdout
    assert signed.returncode == 0, signed.stderr
    assert (folder / "model.sig").is_file()
    assert "content digest sha256:" in signed.stdout
    assert valid.returncode == 0, valid.stdout
    verdict = json.loads(valid.stdout)
    assert verdict["signer"] == "publisher" and verdict["adapter_id"] == "acme-support-v1"
    assert changed.returncode == 1 and "unsigned_file" in changed.stdout
    assert other_id.returncode == 0  # no rule for globex-: off


def test_sign_refuses_a_folder_holding_files_the_sidecar_would_refuse(tmp_path: Path) -> None:
    from sidecar.process.examples import write_adapter
    from tests.support.signing_keys import make_key

    key = make_key(tmp_path / "keys", "k")
    folder = tmp_path / "a"
    write_adapter(folder)
    (folder / "new_embeddings.safetensors").write_bytes(b"tokens added in training")

    result = subprocess.run([sys.executable, "-m", "sidecar", "sign", str(folder), "--key",
                             str(key.private)], capture_output=True, text=True, timeout=60)

    assert result.returncode == 1 and "new_embeddings.safetensors" in result.stderr
    assert not (folder / "model.sig").exists()


def test_a_signing_policy_that_cannot_work_stops_the_start_before_the_cache_is_touched(
    tmp_path: Path
) -> None:
    policy = tmp_path / "signing.toml"
    policy.write_text('[[adapters]]\nprefix = "acme-"\nmode = "require"\nsigners = ["nobody"]\n')

    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--signing-policy", str(policy),
         "--cache-root", str(tmp_path / "cache"), "--registry", str(tmp_path)],
        capture_output=True, text=True, timeout=30)

    assert result.returncode == 2
    assert "--signing-policy" in result.stderr and "no [signers.nobody]" in result.stderr
    assert not (tmp_path / "cache").exists()


def test_validate_judges_the_rank_by_the_same_setting_as_serve(tmp_path: Path) -> None:
    """rank_too_large names --max-lora-rank (LORA_SIDECAR_MAX_LORA_RANK): validate reads that
    variable as serve does, and its own flag overrides it."""
    from sidecar.process.examples import write_adapter

    folder = tmp_path / "rank-32-v1"
    write_adapter(folder, rank=32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORA_SIDECAR_")}

    def validate(*args: str, **variables: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sidecar", "validate", str(folder), *args],
                              capture_output=True, text=True, timeout=60,
                              env={**env, **variables})

    default = validate()
    assert default.returncode == 1, default.stdout + default.stderr
    assert "rank_too_large" in default.stdout and "LORA_SIDECAR_MAX_LORA_RANK" in default.stdout
    raised = validate(LORA_SIDECAR_MAX_LORA_RANK="32")
    assert raised.returncode == 0, raised.stdout + raised.stderr
    flag = validate("--max-lora-rank", "16", LORA_SIDECAR_MAX_LORA_RANK="32")
    assert flag.returncode == 1 and "rank_too_large" in flag.stdout, flag.stdout
    bad = validate(LORA_SIDECAR_MAX_LORA_RANK="zero")
    assert bad.returncode == 2
    assert "--max-lora-rank (LORA_SIDECAR_MAX_LORA_RANK) = 'zero'" in bad.stderr, bad.stderr


@pytest.mark.parametrize(("args", "fragment"), [
    (["--port", "abc"], "--port (LORA_SIDECAR_PORT) = 'abc': not a whole number"),
    (["--lease-ttl", "soon"], "--lease-ttl (LORA_SIDECAR_LEASE_TTL) = 'soon': not a number"),
])
def test_a_value_that_is_not_a_number_says_so_in_words(
    tmp_path: Path, args: list[str], fragment: str
) -> None:
    result = subprocess.run([sys.executable, "-m", "sidecar", "serve", *args, "--cache-root",
                             str(tmp_path / "cache")], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert fragment in result.stderr, result.stderr
    assert "invalid literal" not in result.stderr and "could not convert" not in result.stderr


@pytest.mark.parametrize(("args", "suggestion", "usage"), [
    (["serve", "--max-lora-rnk", "32"], "did you mean --max-lora-rank?", "lora-sidecar serve"),
    (["stage", "a", "--timout", "5"], "did you mean --timeout?", "lora-sidecar stage"),
    (["validate", ".", "--engine-confg", "x"], "did you mean --engine-config?",
     "lora-sidecar validate"),
])
def test_a_misspelt_option_gets_its_commands_usage_and_the_nearest_option(
    args: list[str], suggestion: str, usage: str
) -> None:
    result = subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2
    assert f"unrecognized arguments: {args[-2]} {args[-1]}; {suggestion}" in result.stderr, \
        result.stderr
    assert f"usage: {usage}" in result.stderr
