"""The README and the pages of docs/ against the code: every error code the API can answer is in
the reference's error table with the status the API answers it with, the contributor's guide names
every module, the README's quick start runs as written, in order, and every link between the
pages leads somewhere."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from sidecar.core import errors
from tests.support.api import api_error_codes
from tests.support.paths import REPO
from tests.support.processes import free_port, http_status
from tests.support.waiting import eventually_blocking

README = REPO / "README.md"
DOCS = REPO / "docs"
REFERENCE = DOCS / "reference.md"  # the HTTP API and its error table
CONTRIBUTING = DOCS / "contributing.md"  # "How the code is laid out"


def reference_error_table() -> dict[str, set[int]]:
    """`error` code -> the statuses its rows give, from the table whose header is
    `| status | `error` | when |`."""
    lines = REFERENCE.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines)
                 if re.fullmatch(r"\|\s*status\s*\|\s*`error`\s*\|\s*when\s*\|", line.strip()))
    table: dict[str, set[int]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        status, codes = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for code in re.findall(r"`([a-z_]+)`", codes):
            table.setdefault(code, set()).add(int(status))
    return table


def test_every_error_code_of_the_api_is_in_the_reference_with_its_status() -> None:
    table = reference_error_table()
    codes = api_error_codes()
    assert {"not_ready", "not_found", "method_not_allowed", "internal_error"} <= set(codes)
    missing = sorted(code for code in codes if code not in table)
    assert not missing, f"the reference's error table lacks {missing}"
    wrong = {code: (status, sorted(table[code])) for code, status in codes.items()
             if status not in table[code]}
    assert not wrong, f"the reference gives other statuses (code: (API's, its)): {wrong}"


def test_the_reference_lists_no_code_the_api_cannot_answer() -> None:
    stale = sorted(set(reference_error_table()) - set(api_error_codes()))
    assert not stale, f"the reference's error table lists codes the API never answers: {stale}"


# ---- the layout ----------------------------------------------------------------------------


def layout_rows() -> dict[str, set[str]]:
    """Folder (or top-level module) -> the module names its row of "How the code is laid out"
    gives."""
    text = CONTRIBUTING.read_text(encoding="utf-8")
    section = text[text.index("## How the code is laid out"):]
    block = section.split("```")[1]
    rows: dict[str, set[str]] = {}
    current = ""
    for line in block.strip().splitlines():
        if line.startswith("sidecar/"):
            current, _, line = line.partition(" ")
            rows[current] = {Path(current).name} if current.endswith(".py") else set()
        rows[current] |= set(re.findall(r"\b([a-z0-9_]+\.py)\b", line))
    return rows


def test_the_layout_names_every_module_of_sidecar_in_its_folder_and_no_other() -> None:
    rows = layout_rows()
    named = {(folder if folder.endswith("/") else "sidecar/", module)
             for folder, modules in rows.items() for module in modules
             if folder.endswith("/") or module == Path(folder).name}
    on_disk = {(f"{path.parent.relative_to(REPO).as_posix()}/", path.name)
               for path in (REPO / "sidecar").rglob("*.py") if path.name != "__init__.py"}
    assert sorted(on_disk - named) == [], "modules the layout in docs/ does not name"
    assert sorted(named - on_disk) == [], "modules the layout in docs/ names that do not exist"


# ---- the quick start, run as written ------------------------------------------------------


def quick_start() -> tuple[list[str], dict[str, object]]:
    """The `sh` blocks of "The two commands" after the first (make run / make test), each one
    script, and the JSON answer it shows for the first curl."""
    text = README.read_text(encoding="utf-8")
    start = text.index("## The two commands")
    section = text[start:text.index("\n## ", start)]
    blocks = re.findall(r"```(sh|json)\n(.*?)```", section, flags=re.DOTALL)
    scripts = [body for kind, body in blocks if kind == "sh"][1:]
    answer = json.loads(next(body for kind, body in blocks if kind == "json"))
    return scripts, answer


def make_run_recipe() -> list[str]:
    """The commands of the Makefile's `run` target."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("run:")))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_the_quick_start_runs_in_order_as_written(tmp_path: Path) -> None:
    """From `make run` (its recipe, in an empty folder, on a free port) through every command
    of the README's quick start, in order: each one succeeds, and the first answer has the
    fields the README shows."""
    scripts, shown = quick_start()
    bin_dir = str(Path(sys.executable).parent)
    port = free_port()
    env = {**os.environ, "LORA_SIDECAR_PORT": str(port),
           "LORA_SIDECAR_URL": f"http://127.0.0.1:{port}"}
    *setup, serve = [line.replace("$(BIN)", bin_dir) for line in make_run_recipe()]
    for command in setup:
        subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, check=True, timeout=60)
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(["sh", "-c", serve], cwd=tmp_path, env=env, stdout=log,
                               stderr=subprocess.STDOUT)

    def ready() -> bool:
        if http_status(f"http://127.0.0.1:{port}/readyz") == 200:
            return True
        assert process.poll() is None, (tmp_path / "serve.log").read_text()
        return False

    try:
        eventually_blocking(ready, timeout_s=30, poll_s=0.1,
                            what=lambda: (tmp_path / "serve.log").read_text())
        outputs = []
        for script in scripts:
            script = script.replace("localhost:8500", f"localhost:{port}").replace(
                ".venv/bin/", f"{bin_dir}/")
            done = subprocess.run(["sh", "-ec", script], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, (script, done.stdout, done.stderr)
            outputs.append(done.stdout)
    finally:
        process.terminate()
        process.wait(20)
        log.close()
    answer = json.loads(outputs[0])
    assert set(answer) == set(shown)
    for key in ("adapter_id", "size_bytes", "lora_name", "cached", "lease_id",
                "lease_expires_at"):
        assert answer[key] == shown[key], key
    assert answer["local_path"] == str(tmp_path / ".lora-cache" / "adapters" /
                                       "example-support-v1")
    assert str(shown["content_digest"]).rstrip("…") in answer["content_digest"]


# ---- every cause of every code ---------------------------------------------------------------

# Each place in sidecar/ that makes an error the API answers (module:function), and the words
# of the reference's error table that name that cause, in the row of its code. A new place fails
# the test below until its cause is in the table and here.
ERROR_CAUSES: dict[tuple[str, str], str] = {
    ("adapter_in_use", "cache/store.py:evict"): "evicting a pinned, leased or about-to-be-leased",
    ("adapter_not_found", "cache/refusals.py:not_found"): "remembered for `--not-found-ttl`",
    ("adapter_not_found", "registry/local.py:_scan_files"): "not in the registry",
    ("adapter_not_found", "registry/s3_client.py:_list_files"): "not in the registry",
    ("cache_full", "cache/pins.py:check_room"): "`POST /pin` when pinned adapters fill",
    ("cache_full", "cache/stager.py:_disk_error"): "ran out of space during the download",
    ("cache_full", "cache/store.py:_make_disk_room"): "the disk cannot hold it above",
    ("cache_full", "cache/store.py:_reserve"): "pinned adapters hold the room",
    ("cache_full", "cache/store.py:_reserve_in_turn"): "did not free within the caller's deadline",
    ("cache_full", "cache/store.py:fits_budget"): "larger than `--max-bytes`",
    ("cache_not_writable", "cache/stager.py:_disk_error"): "the cache volume refuses writes",
    ("catalog_disabled", "web/api.py:compact"): "renders no catalog",
    ("catalog_pending", "catalog/catalog.py:_no_name"): "a name's link could not be made",
    ("catalog_pending", "catalog/catalog.py:name"): "left the disk before a name was given",
    ("catalog_pending", "catalog/serving.py:_not_serving"): "no engine serves a catalog yet",
    ("catalog_pending", "catalog/serving.py:naming_generation"): "no catalog is rendered yet",
    ("catalog_pending", "catalog/serving.py:no_name_left"): "no name for this adapter and no spare",
    ("catalog_reloading", "catalog/serving.py:_not_serving"): "an `unload-first` reload",
    ("engine_failed", "catalog/engine_refusal.py:judge"): "the engine failed on the request itself",
    ("engine_unavailable", "catalog/engine_refusal.py:judge"): "what refused it will end",
    ("forbidden", "web/api.py:_refuse"): "outside its prefix",
    ("invalid_adapter", "cache/refusals.py:refuse"): "refused by validation",
    ("invalid_adapter", "core/errors.py:recalled"): "answered from memory",
    ("invalid_adapter_id", "core/ids.py:check_adapter_id"): "bad id",
    ("invalid_request", "catalog/engine_refusal.py:from_json"): "a malformed `engine_refused`",
    ("invalid_request", "web/api.py:_body_at_hand"): "not `Content-Type: application/json`",
    ("invalid_request", "web/api.py:_checked"): "malformed JSON",
    ("invalid_request", "web/api.py:_read_body"): "the connection closed before the body",
    ("lease_not_found", "cache/leases.py:release"): "no such live lease",
    ("method_not_allowed", "web/api.py:_method_not_allowed"): "takes another method",
    ("method_not_allowed", "web/api.py:refuse"): "takes another method",
    ("not_cached", "cache/store.py:evict"): "not on disk (`POST /evict`",
    ("not_cached", "web/api.py:get_adapter"): "`GET /adapters/{id}`",
    ("not_found", "web/api.py:_not_found"): "no such endpoint",
    ("not_found", "web/api.py:metrics_epp"): "`/metrics/epp` while `--epp-metrics` is off",
    ("not_ready", "web/api.py:_recovered"): "while the start-up recovery still runs",
    ("not_ready", "web/api.py:readyz"): "not ready yet",
    ("registry_error", "registry/httpranges.py:_refusal"): "the registry refused",
    ("registry_error", "registry/s3_client.py:_translate"): "the registry refused",
    ("registry_object_changed", "registry/httpranges.py:_check_range"): "changed between listing",
    ("registry_object_changed", "registry/httpranges.py:_refusal"): "changed between listing",
    ("registry_object_changed", "registry/local.py:_open_listed"): "changed between listing",
    ("registry_object_changed", "registry/local.py:readinto"): "changed between listing",
    ("registry_object_changed", "registry/s3_client.py:_translate"): "changed between listing",
    ("registry_transient", "cache/stager.py:_fetch_and_validate"): "damaged on every download",
    ("registry_transient", "cache/stager.py:_fetch_intact"): "damaged on every download",
    ("registry_unavailable", "registry/httpranges.py:_refusal"): "unreachable",
    ("registry_unavailable", "registry/httpranges.py:fault"): "unreachable",
    ("registry_unavailable", "registry/local.py:_check_root"): "unreachable",
    ("registry_unavailable", "registry/local.py:readinto"): "unreachable",
    ("registry_unavailable", "registry/s3_client.py:_translate"): "unreachable",
    ("registry_unavailable", "registry/s3_client.py:_transfer"): "unreachable",
    ("registry_unavailable", "registry/s3_client.py:sign"): "unreachable",
    ("registry_unavailable", "registry/transfer.py:_copy"): "unreachable",
    ("registry_unavailable", "registry/transfer.py:_open"): "unreachable",
    ("registry_unavailable", "registry/transfer.py:_stream_part"): "unreachable",
    ("stage_timeout", "cache/stager.py:_await_stage"): "`timeout_s` ran out",
    ("unauthorized", "web/api.py:_authorize"): "missing or wrong bearer token",
}


def error_sites() -> set[tuple[str, str]]:
    """(code, module:function) of every call in sidecar/ that makes an error the API answers."""
    codes = {name: cls.code for name, cls in vars(errors).items()
             if isinstance(cls, type) and issubclass(cls, errors.SidecarError)
             and cls is not errors.SidecarError}
    sites = set()
    for path in sorted((REPO / "sidecar").rglob("*.py")):
        module = path.relative_to(REPO / "sidecar").as_posix()
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in codes):
                    sites.add((codes[node.func.id], f"{module}:{function.name}"))
    return sites


def test_every_cause_of_every_error_code_is_in_the_reference_row_of_its_code() -> None:
    lines = REFERENCE.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| status | `error` |"))
    rows: dict[str, str] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        for code in re.findall(r"`([a-z_]+)`", cells[1]):
            rows[code] = rows.get(code, "") + " " + cells[2]
    sites = error_sites()
    unlisted = sorted(sites - ERROR_CAUSES.keys())
    assert not unlisted, f"places that make an error with no cause named here: {unlisted}"
    assert sorted(ERROR_CAUSES.keys() - sites) == [], "causes of places that are gone"
    missing = sorted((code, words) for (code, _), words in ERROR_CAUSES.items()
                     if words not in rows.get(code, ""))
    assert not missing, f"causes the README's error table does not name: {missing}"


# ---- signing, as the README walks through it -------------------------------------------------


def signing_walkthrough() -> tuple[str, str]:
    """The signing page's policy (TOML) and its key-making and signing commands (sh)."""
    text = (DOCS / "signing.md").read_text()
    section = text[text.index("# Signed adapters"):]
    policy = re.search(r"^```toml\n(.*?)^```", section, re.M | re.S)
    steps = re.search(r"\*\*Making the keys, signing, uploading\.\*\*.*?^```sh\n(.*?)^```",
                      section, re.M | re.S)
    assert policy is not None and steps is not None
    return policy.group(1), steps.group(1)


def test_the_signing_steps_make_every_file_the_policy_reads_and_both_adapters_pass(
    tmp_path: Path,
) -> None:
    """In an empty folder holding the two adapter folders: the policy saved as signing.toml,
    then the README's commands in order (the upload left out). Every key and CA file the
    policy names then exists, both signed adapters pass `validate --policy`, and the
    certificate's identity is the one the policy requires."""
    from sidecar.process.examples import write_adapter

    policy, steps = signing_walkthrough()
    (tmp_path / "signing.toml").write_text(policy)
    for adapter_id in ("acme-support-v5", "globex-chat-v2"):
        write_adapter(tmp_path / adapter_id)
    script = "\n".join(line for line in steps.replace("\\\n", " ").splitlines()
                       if not line.startswith("aws s3 "))
    venv_bin = str(Path(sys.executable).parent)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stdout + result.stderr
    for named in re.findall(r'"((?:keys|ca)/[^"]+)"', policy):
        assert (tmp_path / named).is_file(), named
    for adapter_id in ("acme-support-v5", "globex-chat-v2"):
        assert (tmp_path / adapter_id / "model.sig").is_file()
        assert re.search(rf"^OK .*{adapter_id}", result.stdout, re.M), result.stdout
    # a policy that wants another identity refuses the certificate's signature
    (tmp_path / "other.toml").write_text(policy.replace("release@globex.example",
                                                        "someone@globex.example"))
    refused = subprocess.run([sys.executable, "-m", "sidecar", "validate",
                              str(tmp_path / "globex-chat-v2"), "--policy",
                              str(tmp_path / "other.toml")],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "signer_not_allowed" in refused.stdout, refused.stdout


# ---- the pages and their links --------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"^\s*```.*?^\s*```[^\n]*$", flags=re.DOTALL | re.MULTILINE)


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them: lower case, punctuation but `-`
    and `_` dropped, spaces as `-`, a repeated one numbered."""
    seen: dict[str, int] = {}
    for line in FENCED.sub("", page.read_text(encoding="utf-8")).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}-{count}"] = 1
    return set(seen)


def test_every_page_of_docs_is_linked_from_the_readme_and_every_link_leads_somewhere() -> None:
    """Each page of docs/ is reachable from the README, and every relative link of the README
    and of docs/ names a file that exists and, with `#`, a heading of it."""
    pages = [README, *sorted(DOCS.glob("*.md"))]
    assert {REFERENCE, CONTRIBUTING} <= set(pages)
    linked: set[Path] = set()
    broken = []
    for page in pages:
        for target in LINK.findall(FENCED.sub("", page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue  # a URL, not a page of the checkout
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if page == README:
                linked.add(file)
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}: no such file")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                broken.append(f"{page.relative_to(REPO)}: {target}: no such heading")
    assert not broken, broken
    unlinked = [str(p.relative_to(REPO)) for p in pages[1:] if p not in linked]
    assert not unlinked, f"pages of docs/ the README does not link: {unlinked}"
