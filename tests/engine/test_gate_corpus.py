"""vLLM as the judge of the validation gate. Every adapter kind of the corpus goes through the
real engine on its own (vLLM offline, one engine kept alive across adapters, a fresh one when one
dies) and through `lora-sidecar validate`; the gate must refuse every adapter the engine refuses,
dies of, serves wrongly or emptily, or that disturbs the next adapter's answer, and accept every
adapter the engine serves correctly (its text equal to transformers + peft's), unless the case
names the policy the gate refuses it for (new embeddings, an ambiguous header...).

Every new rule of the gate gets its case here.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sidecar.__main__ import main as sidecar_main
from tests.engine.harness import (
    ENGINE_MODEL,
    GOOD_ADAPTERS,
    MAX_LORA_RANK,
    MAX_TOKENS,
    PEFT_CASES,
    PROMPT,
    EngineAssets,
    Reference,
    engine_args,
)
from tests.engine.surgery import (
    CONFIG,
    copy_adapter,
    delete,
    edit_config,
    edit_tensors,
    first_tensor,
    non_finite,
)
from tests.support import broken_adapters

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CONTROL = "tenant-0"
WEIGHT_SCALE = 0.1  # the known-good adapter asked right after each case
# Cases the gate refuses by policy even where this engine serves them correctly, and why.
POLICY = {
    "header_leading_whitespace": "safetensors header ambiguity: the format says it starts "
                                 "with '{'; other readers may refuse it",
    "duplicate_names": "safetensors header ambiguity: readers differ on which entry wins",
    "unknown_entry_key": "safetensors header ambiguity: keys this reader ignores",
    "pickle_weights_only": "the engine would torch.load the pickle, which can run code",
    "new_embeddings": "vLLM 0.13 ignores new embeddings: the adapter would not answer as "
                      "trained; older versions unpickle them",
    "symlink": "a link's target can change behind the published path",
    "checksum_mismatch": "the files are not what SHA256SUMS says was uploaded",
    "base_model_mismatch": "the operator's --base-model",
    "long_context": "trained for long-context scaling this vLLM no longer applies",
    "integer_dtype": "integer tensors are not trained LoRA weights; vLLM casts them silently",
}
REFUSES = ("refused", "killed the engine", "disturbed another adapter", "served wrong text",
           "served empty text", "served, but no correct output exists")


@dataclass(frozen=True)
class Case:
    name: str
    folder: Path
    policy: str | None = None
    base_model: str | None = None  # validate with --base-model


def _surgery_cases(assets: EngineAssets, root: Path) -> list[Case]:
    """Kinds made from a good adapter: what the real engine showed, and the gate's own rules."""
    f16, f32 = assets.adapter("tenant-1"), assets.adapter("f32-qv")
    cases: list[Case] = []

    def case(name: str, source: Path, change: Callable[[Path], object]) -> None:
        folder = copy_adapter(source, root / name)
        change(folder)
        cases.append(Case(name, folder))

    for name, value, half in (("nan_in_b", float("nan"), "B"), ("inf_in_b", float("inf"), "B"),
                              ("minus_inf_in_a", float("-inf"), "A")):
        cases.append(Case(name, non_finite(f16, root / name, value, half)))
        cases.append(Case(name + "_f32", non_finite(f32, root / (name + "_f32"), value, half)))
    case("no_adapter_config", f16, lambda f: (f / CONFIG).unlink())
    case("missing_lora_alpha", f16, lambda f: edit_config(f, lora_alpha=delete()))
    case("bias_all", f16, lambda f: edit_config(f, bias="all"))

    def drop_layer_b(folder: Path) -> None:
        edit_tensors(folder, lambda t: t.pop(first_tensor(t, "B")))

    case("one_lora_b_missing", f16, drop_layer_b)
    return cases


def corpus(assets: EngineAssets, root: Path) -> list[Case]:
    cases = [Case(name, assets.adapter(name)) for name in GOOD_ADAPTERS
             if not name.startswith("tenant-") or name == "tenant-1"]
    cases += [Case(name, assets.adapter(name)) for name in PEFT_CASES]
    # Weights strong enough that a module served with the wrong scale changes the text.
    with broken_adapters.written_for(ENGINE_MODEL, scale=WEIGHT_SCALE):
        for broken in broken_adapters.CORPUS:
            folder = root / broken.name
            folder.mkdir(parents=True)
            broken.write(folder)
            cases.append(Case(broken.name, folder, POLICY.get(broken.name), broken.base_model))
    cases += _surgery_cases(assets, root / "surgery")
    return cases


# ---- the two verdicts ---------------------------------------------------------------------


def engine_verdict(facts: dict[str, Any], reference: Reference, control: str) -> tuple[str, str]:
    """(verdict, detail) from what the engine did with the adapter and the reference text."""
    if facts["killed"]:
        return "killed the engine", facts["killed"]
    if facts["refused"]:
        return "refused", facts["refused"] + " (on the serving path: the engine dies)"
    if facts["control_after"] != control:
        return "disturbed another adapter", (f"{CONTROL} answered {facts['control_after']!r}, "
                                             f"not {control!r}")
    if not reference.fits:
        return "served, but no correct output exists", f"{reference.reason}; served " \
            f"{facts['text']!r}"
    if facts["text"] == "":
        return "served empty text", f"the reference is {reference.text!r}"
    if facts["text"] != reference.text:
        return "served wrong text", f"{facts['text']!r}, the reference is {reference.text!r}"
    return "served correctly", repr(facts["text"])


def gate_verdict(case: Case, base_config: Path) -> list[str]:
    """The problem codes `lora-sidecar validate` reports ([] when it accepts)."""
    out = io.StringIO()
    extra = ["--base-model", case.base_model] if case.base_model else []
    with contextlib.redirect_stdout(out):
        code = sidecar_main(["validate", "--json", "--max-lora-rank", str(MAX_LORA_RANK),
                             "--base-model-config", str(base_config), *extra,
                             str(case.folder)])
    verdict = json.loads(out.getvalue())
    assert code == (0 if verdict["valid"] else 1), (code, verdict)
    return sorted({problem["code"] for problem in verdict["problems"]})


def test_the_gate_refuses_what_the_engine_cannot_serve_and_accepts_what_it_serves(
    engine_assets: EngineAssets, tmp_path: Path, engine_figures: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cases = corpus(engine_assets, tmp_path / "corpus")
    names = [case.name for case in cases]
    assert len(set(names)) == len(names)
    references = engine_assets.references({case.name: case.folder for case in cases
                                           if (case.folder / CONFIG).exists()})
    control = engine_assets.text(CONTROL)
    args = engine_args(engine_assets.base)
    args.pop("model")
    out = tmp_path / "verdicts.jsonl"
    engine_assets.env.run_worker(
        "judge",
        {"base": str(engine_assets.base), "engine_args": args, "prompt": PROMPT,
         "max_tokens": MAX_TOKENS, "control": {"path": str(engine_assets.adapter(CONTROL)),
                                               "text": control},
         "cases": [{"name": case.name, "path": str(case.folder)} for case in cases]},
        out, timeout_s=900, log=tmp_path / "judge.log")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["control_first"] == control, (lines[0], control)
    facts = {line["name"]: line for line in lines[1:-1]}
    summary = lines[-1]

    rows, disagreements = [], []
    no_config = Reference(False, None, "no adapter_config.json: PEFT cannot load it")
    for case in cases:
        verdict, detail = engine_verdict(facts[case.name], references.get(case.name, no_config),
                                         control)
        codes = gate_verdict(case, engine_assets.base_config)
        gate = "refused: " + ", ".join(codes) if codes else "accepted"
        if verdict == "served correctly":
            agree = not codes if case.policy is None else bool(codes)
        else:
            agree = bool(codes)
        rows.append((case.name, verdict, gate, "yes" if agree else "NO",
                     case.policy or detail))
        if not agree:
            disagreements.append(f"{case.name}: engine {verdict} ({detail}); gate {gate}"
                                 + (f"; policy: {case.policy}" if case.policy else ""))

    table = _table(rows)
    with capsys.disabled():
        print("\n" + table)
    (tmp_path.parent / "corpus-verdicts.txt").write_text(table)
    engine_figures["gate corpus"] = (f"{len(cases)} adapters, {summary['engine_starts']} engine "
                                     f"start(s), {summary['seconds']} s in the engine")
    assert not disagreements, "the gate and the engine disagree:\n" + "\n".join(disagreements)
    judged = {row[1] for row in rows}
    assert "served correctly" in judged and judged & set(REFUSES)


def _table(rows: list[tuple[str, str, str, str, str]]) -> str:
    header = ("adapter", "engine", "gate", "agree", "why")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header[:4], widths, strict=True)) + " | why"]
    for row in rows:
        cells = [str(c).ljust(w) for c, w in zip(row[:4], widths, strict=True)]
        lines.append(" | ".join(cells) + " | " + row[4][:140].replace("\n", " "))
    return "\n".join(lines)
