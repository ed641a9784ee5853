"""The README and the pages of docs/ against the code: every error code the API can answer is in
the reference's error table with the status the API answers it with, the contributor's guide names
every module, the README's quick start runs as written, in order, and every link between the
pages leads somewhere."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

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
