"""Adapter validation: refuse, before it is published, every adapter vLLM cannot load or that is
unsafe, naming every reason at once. Plain synchronous functions (the core runs them in a thread);
rule ids such as A7 or C4 refer to the vLLM adapter acceptance checklist, sections A-D. Which
files are judged at all is files.py's rule.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from ..core.errors import ConfigError
from ..core.filehash import hash_file, open_regular
from .adapter_config import LoraConfig, check_adapter_config
from .files import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    SIGNATURE_FILE,
    SIGNATURE_MAX_BYTES,
    WEIGHTS_FILE,
    FileRole,
    classify,
    leaves_folder,
    listed,
    plan_folder,
)
from .options import ValidationOptions
from .problem import Problem, ProblemCode
from .safetensors_check import TensorInfo, check_safetensors, shown
from .shapes import ATTENTION_MODULES, ModelShapes
from .signatures import verify_folder
from .signing_policy import NO_POLICY, SigningPolicy
from .values import Layout, NonFinite, ValueReport, scan_file

CONFIG_MAX_BYTES = 1024**2
CHECKSUMS_MAX_BYTES = 64 * 1024
MAX_PROBLEMS_PER_CODE = 20  # a header of a million bad tensors must not make a huge answer

_NAME_PREFIX = "base_model.model."
_LORA_NAME = re.compile(
    r"(?P<path>(?:[A-Za-z0-9_]+\.)*(?P<module>[A-Za-z0-9_]+))"
    r"\.lora_(?:(?P<half>[AB])\.weight|embedding_(?P<embedding_half>[AB]))"
)
_LLAMA_PATH = re.compile(r"model\.layers\.(?P<layer>0|[1-9][0-9]*)\.(?P<block>self_attn|mlp)\.\w+")
_CHECKSUM_LINE = re.compile(r"(?P<digest>[0-9a-fA-F]{64}) [ *](?:\./)?(?P<name>.+)")


_DEFAULTS = ValidationOptions()  # the options' own defaults, declared once there


@dataclass(frozen=True, slots=True)
class Rules:
    max_lora_rank: int = _DEFAULTS.max_lora_rank
    allowed_target_modules: frozenset[str] = frozenset(_DEFAULTS.allowed_target_modules)
    base_model: str | None = None
    shapes: ModelShapes | None = None  # from --base-model-config
    signing: SigningPolicy = NO_POLICY  # from --signing-policy

    @classmethod
    def from_settings(cls, settings: ValidationOptions) -> Rules:
        problems = []
        shapes = None
        if settings.base_model_config is not None:
            try:
                shapes = ModelShapes.from_file(settings.base_model_config)
            except (OSError, ValueError) as exc:
                problems.append(f"--base-model-config: {exc}")
        signing = NO_POLICY
        if settings.signing_policy is not None:
            try:
                signing = SigningPolicy.load(settings.signing_policy)
            except ValueError as exc:
                problems.append(f"--signing-policy {settings.signing_policy}: {exc}")
        if problems:
            raise ConfigError(problems)
        return cls(
            max_lora_rank=settings.max_lora_rank,
            allowed_target_modules=frozenset(settings.allowed_target_modules),
            base_model=settings.base_model,
            shapes=shapes,
            signing=signing,
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    problems: list[Problem]  # [] when the adapter is valid
    ignored: tuple[str, ...]  # entries the engine never reads: not judged, never published


def validate_adapter(
    folder: Path,
    rules: Rules,
    *,
    sha256: Mapping[str, str] | None = None,
    scan_values: bool = True,
    scanned: Mapping[str, ValueReport] | None = None,
    checksums: bool = True,
) -> list[Problem]:
    """Every problem of the adapter in `folder`; [] when it is valid (see `judge_adapter`)."""
    return judge_adapter(folder, rules, sha256=sha256, scan_values=scan_values, scanned=scanned,
                         checksums=checksums).problems


def judge_adapter(
    folder: Path,
    rules: Rules,
    *,
    sha256: Mapping[str, str] | None = None,
    scan_values: bool = True,
    scanned: Mapping[str, ValueReport] | None = None,
    checksums: bool = True,
) -> Verdict:
    """The verdict on the adapter in `folder`: every problem, and the entries the rule of
    files.py ignores. Never raises for what the folder holds. `sha256` maps file names to
    digests already computed while downloading;
    `scanned` maps file names to value checks already made while downloading.
    `scan_values=False` leaves the tensor values unread (a restart: they were checked before
    publication), except when the weights are read anyway to check a SHA256SUMS file.
    `checksums=False` leaves out hashing the files listed in SHA256SUMS (a restart re-checks
    the rules of a published folder, whose bytes its record vouches for)."""
    problems, readable, ignored = _check_folder(folder)
    config: LoraConfig | None = None
    digests = dict(sha256 or {})
    # A file that cannot be read (a race with a deletion, an I/O error) is that file's problem.
    if CONFIG_FILE in readable:
        try:
            config_problems, config = _check_config(folder, rules)
            problems.extend(config_problems)
        except OSError as exc:
            problems.append(_read_error(CONFIG_FILE, exc))
    if WEIGHTS_FILE in readable:
        # The weights are read at most once: their SHA-256 for SHA256SUMS in the same pass.
        hash_too = checksums and CHECKSUMS_FILE in readable and WEIGHTS_FILE not in digests
        try:
            weight_problems, digest = _check_weights(
                folder, rules, config, scan_values=scan_values, hash_too=hash_too,
                scanned=(scanned or {}).get(WEIGHTS_FILE))
            problems.extend(weight_problems)
            if digest is not None:
                digests[WEIGHTS_FILE] = digest
        except OSError as exc:
            problems.append(_read_error(WEIGHTS_FILE, exc))
    if CHECKSUMS_FILE in readable and checksums:
        try:
            problems.extend(_check_checksums(folder, readable, digests))
        except OSError as exc:
            problems.append(_read_error(CHECKSUMS_FILE, exc))
    return Verdict(_bounded(problems), ignored)


def listed_size_problems(sizes: Mapping[str, int], *, signature_checked: bool) -> list[Problem]:
    """What the listed sizes alone refuse, before a byte is fetched: a config or (when a
    signature will be checked) a model.sig larger than the most ever read of it."""
    problems = []
    if sizes.get(CONFIG_FILE, 0) > CONFIG_MAX_BYTES:
        problems.append(Problem("config_too_large", CONFIG_FILE,
                                f"listed at {sizes[CONFIG_FILE]} bytes, larger than "
                                f"{CONFIG_MAX_BYTES} bytes; nothing was downloaded"))
    if signature_checked and sizes.get(SIGNATURE_FILE, 0) > SIGNATURE_MAX_BYTES:
        problems.append(Problem("signature_malformed", SIGNATURE_FILE,
                                f"listed at {sizes[SIGNATURE_FILE]} bytes, larger than "
                                f"{SIGNATURE_MAX_BYTES} bytes; nothing was downloaded"))
    return problems


def judge_config(data: bytes, rules: Rules) -> list[Problem]:
    """The problems of an adapter_config.json alone, from its bytes: judged in memory before
    room is reserved, so an adapter its config refuses costs no room and no disk."""
    return _config_problems(data, rules)[0]


def _read_error(file: str, exc: OSError) -> Problem:
    return Problem("read_error", file, f"cannot read it: {shown(str(exc))}")


def _check_folder(folder: Path) -> tuple[list[Problem], set[str], tuple[str, ...]]:
    """Problems of the folder's entries, the names of the files fit to be read, and the
    entries ignored."""
    try:
        mode = os.lstat(folder).st_mode
        if stat.S_ISLNK(mode):
            return [Problem("symlink", "", "the adapter folder is a symbolic link; its target "
                            "could change behind the published path")], set(), ()
        if not stat.S_ISDIR(mode):
            return [Problem("not_a_folder", "", f"{shown(str(folder))} is not a folder")], set(), ()
        plan = plan_folder(folder)
    except OSError as exc:
        return [Problem("read_error", "", f"cannot read the folder: {shown(str(exc))}")], set(), ()
    problems = list(plan.problems)
    readable: set[str] = set()
    for name in plan.fetched:
        try:
            links = os.lstat(folder / name).st_nlink
        except OSError as exc:
            problems.append(_read_error(name, exc))
            continue
        readable.add(name)
        if links > 1:
            # Another name for the same bytes could rewrite a published adapter in place.
            problems.append(Problem("hard_link", name, f"the file has {links} hard links; a "
                                    "published adapter must own its bytes"))
    return problems, readable, plan.ignored


def _open_regular(path: Path) -> BinaryIO:
    """Open for reading without following a link swapped in since the folder was listed."""
    return os.fdopen(open_regular(path), "rb", buffering=0)


def _read_capped(path: Path, limit_bytes: int) -> bytes | None:
    """The whole file, or None when it is larger than `limit_bytes` (then nothing is read)."""
    with _open_regular(path) as f:
        if os.fstat(f.fileno()).st_size > limit_bytes:
            return None
        data = f.read(limit_bytes + 1)
        return data if len(data) <= limit_bytes else None


def _check_config(folder: Path, rules: Rules) -> tuple[list[Problem], LoraConfig | None]:
    return _config_problems(_read_capped(folder / CONFIG_FILE, CONFIG_MAX_BYTES), rules)


def _config_problems(data: bytes | None,
                     rules: Rules) -> tuple[list[Problem], LoraConfig | None]:
    """The config's problems from its bytes (None: it was larger than the cap, left unread)."""
    if data is None or len(data) > CONFIG_MAX_BYTES:
        return [Problem("config_too_large", CONFIG_FILE,
                        f"larger than {CONFIG_MAX_BYTES} bytes")], None
    faults, config = check_adapter_config(
        data,
        max_lora_rank=rules.max_lora_rank,
        allowed_target_modules=rules.allowed_target_modules,
        base_model=rules.base_model,
    )
    return [Problem(code, CONFIG_FILE, message) for code, message in faults], config


# ---- adapter_model.safetensors (checklist C1-C10, D1-D14) ---------------------------------


def _check_weights(
    folder: Path, rules: Rules, config: LoraConfig | None, *, scan_values: bool,
    hash_too: bool, scanned: ValueReport | None,
) -> tuple[list[Problem], str | None]:
    """The weights' problems, and their SHA-256 when `hash_too` (None if not computed)."""
    path = folder / WEIGHTS_FILE
    with _open_regular(path) as f:
        size_bytes = os.fstat(f.fileno()).st_size
        checked = check_safetensors(f, size_bytes, path)
        problems = [Problem(code, WEIGHTS_FILE, message) for code, message in checked.faults]
        if checked.tensors is None:
            return problems, None
        problems.extend(_check_tensors(checked.tensors, config, rules, folder))
        if checked.faults:
            return problems, None  # values of a file whose layout is wrong mean nothing
        report = scanned if scanned is not None and scanned.complete else None
        digest = None
        if (report is None and scan_values) or hash_too:
            hasher = hashlib.sha256() if hash_too else None
            report = scan_file(f.fileno(), size_bytes,
                               Layout(checked.tensors, checked.data_start), hasher)
            digest = hasher.hexdigest() if hasher is not None else None
    if report is not None:
        problems.extend(_non_finite_problem(found) for found in report.nonfinite)
    return problems, digest


def _non_finite_problem(found: NonFinite) -> Problem:
    return _tensor_problem("non_finite_weights", f"tensor `{shown(found.tensor)}` holds "
                           f"{found.describe()}: vLLM serves such an adapter with empty text "
                           "and corrupts the next answer of another adapter")


def _check_tensors(
    tensors: Sequence[TensorInfo], config: LoraConfig | None, rules: Rules, folder: Path
) -> list[Problem]:
    problems: list[Problem] = []
    halves_by_path: dict[str, dict[str, TensorInfo]] = {}
    not_allowed: set[str] = set()
    module_paths: set[str] = set()
    for tensor in tensors:
        parsed = _LORA_NAME.fullmatch(tensor.name.removeprefix(_NAME_PREFIX))
        if parsed is None:
            problems.append(_tensor_problem("unsupported_tensor_name",
                                            f"{shown(tensor.name)} is unsupported LoRA weight"))
            continue
        module_paths.add(parsed["path"])
        module = parsed["module"]
        if module not in rules.allowed_target_modules:
            not_allowed.add(module)
            continue
        if parsed["embedding_half"] and module != "embed_tokens":
            problems.append(_tensor_problem("unsupported_tensor_name", f"{tensor.name}: "
                                            "lora_embedding tensors belong to embed_tokens only"))
            continue
        halves = halves_by_path.setdefault(parsed["path"], {})
        half = parsed["half"] or parsed["embedding_half"]
        if half in halves:
            problems.append(_tensor_problem("duplicate_lora_tensor", f"{tensor.name} and "
                                            f"{halves[half].name} are the same LoRA weight"))
        halves[half] = tensor
    if not_allowed:
        problems.append(_tensor_problem("module_not_allowed", f"While loading {folder}, "
                                        f"expected target modules in "
                                        f"{sorted(rules.allowed_target_modules)} but received "
                                        f"{sorted(not_allowed)}. Please verify that the loaded "
                                        "LoRA module is correct."))
    if not halves_by_path:
        problems.append(_tensor_problem("no_lora_tensors", "the file holds no LoRA tensors; "
                                        "vLLM would silently serve the base model alone"))
    for module_path, halves in sorted(halves_by_path.items()):
        if "A" not in halves or "B" not in halves:
            have, lack = ("A", "B") if "A" in halves else ("B", "A")
            problems.append(_tensor_problem("missing_lora_pair", f"{module_path} has lora_{have} "
                                            f"but no lora_{lack}; vLLM would fail while "
                                            "activating the adapter"))
            continue
        rank = config.rank_for(module_path) if config is not None else None
        problems.extend(_check_pair(module_path, halves["A"], halves["B"], rank, rules.shapes))
    if config is not None and halves_by_path and not problems:
        problems.extend(_check_coverage(config, module_paths, rules))
    return problems


def _check_coverage(config: LoraConfig, module_paths: set[str], rules: Rules) -> list[Problem]:
    """The tensors and the config's target_modules must describe the same modules. vLLM goes by
    the tensors alone; PEFT, which trained the adapter, by target_modules: where they differ,
    what vLLM serves is not what was trained (checklist B15)."""
    problems = []
    untargeted = sorted(p for p in module_paths if config.targets_module(p) is False)
    if untargeted:
        problems.append(_tensor_problem("tensor_module_not_targeted", f"{_listed(untargeted)} "
                                        "hold LoRA tensors, but target_modules does not name "
                                        "them: vLLM would apply them, PEFT never trained them"))
    # A module the config targets that no tensor carries at all: an export that lost it. (A
    # module present in some layers only is left alone: PEFT initialises the others as no-ops.)
    carried = {p.rsplit(".", 1)[-1] for p in module_paths}
    if rules.shapes is not None:
        layout = {m: [f"model.layers.{layer}."
                      f"{'self_attn' if m in ATTENTION_MODULES else 'mlp'}.{m}"
                      for layer in range(rules.shapes.num_hidden_layers)]
                  for m in sorted(rules.allowed_target_modules)
                  if rules.shapes.module_dims(m) is not None}
        lacking = [m for m, paths in layout.items()
                   if m not in carried and any(config.targets_module(p) for p in paths)]
    elif config.targets is not None and config.targets.regex is None:
        # Without the base model's layout, only a listed name no tensor carries can be told.
        lacking = [n for n in config.targets.names if n.rsplit(".", 1)[-1] not in carried]
    else:
        lacking = []
    if lacking:
        problems.append(_tensor_problem("targeted_module_without_tensors", "target_modules "
                                        f"names {_listed(lacking)}, but the file holds no LoRA "
                                        "tensors for them: an incomplete export; vLLM would "
                                        "serve the adapter without them"))
    return problems


def _listed(names: Sequence[str], limit: int = 6) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(shown(n) for n in names[:limit]) + more


def _check_pair(
    module_path: str, a: TensorInfo, b: TensorInfo, rank: int | None, shapes: ModelShapes | None
) -> list[Problem]:
    """A is [r, in] and B is [out, r] (PEFT's layout), with the config's rank and, when the
    base model is known, its in/out sizes (checklist C4, C6)."""
    if len(a.shape) != 2 or len(b.shape) != 2:
        return [_tensor_problem("lora_shape_mismatch", f"{module_path}: lora_A {list(a.shape)} "
                                f"and lora_B {list(b.shape)} must both be 2-D")]
    (rank_a, in_features), (out_features, rank_b) = a.shape, b.shape
    problems = []
    if rank_a != rank_b:
        problems.append(_tensor_problem("lora_shape_mismatch", f"{module_path}: lora_A "
                                        f"{list(a.shape)} and lora_B {list(b.shape)} disagree "
                                        "on the rank"))
    elif rank is not None and rank_a != rank:
        problems.append(_tensor_problem("lora_shape_mismatch", f"{module_path}: the tensors "
                                        f"have rank {rank_a}, {CONFIG_FILE} gives {rank}"))
    module = module_path.rsplit(".", 1)[-1]
    dims = shapes.module_dims(module) if shapes is not None else None
    if shapes is None or dims is None:
        return problems  # only Llama-family projections have known sizes
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    where = _LLAMA_PATH.fullmatch(module_path)
    if where is None or where["block"] != block:
        # vLLM matches only the last name, so a wrong path loads and is never applied.
        problems.append(_tensor_problem("module_path_mismatch", f"{module_path} is not a "
                                        f"module of the base model (model.layers.N.{block}."
                                        f"{module}); vLLM would silently not apply it"))
    elif int(where["layer"]) >= shapes.num_hidden_layers:
        problems.append(_tensor_problem("layer_out_of_range", f"{module_path}: the base model "
                                        f"has {shapes.num_hidden_layers} layers; vLLM would "
                                        "silently not apply it"))
    if (in_features, out_features) != dims:
        problems.append(_tensor_problem("base_shape_mismatch", f"{module_path}: in={in_features} "
                                        f"out={out_features}, the base model's {module} has "
                                        f"in={dims[0]} out={dims[1]}"))
    return problems


def _tensor_problem(code: ProblemCode, message: str) -> Problem:
    return Problem(code, WEIGHTS_FILE, shown(message, limit=1000))


# ---- SHA256SUMS -----------------------------------------------------------------------------


def _check_checksums(folder: Path, readable: set[str], sha256: Mapping[str, str]) -> list[Problem]:
    data = _read_capped(folder / CHECKSUMS_FILE, CHECKSUMS_MAX_BYTES)
    if data is None:
        return [Problem("invalid_checksum_file", CHECKSUMS_FILE,
                        f"larger than {CHECKSUMS_MAX_BYTES} bytes")]
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return [Problem("invalid_checksum_file", CHECKSUMS_FILE, "not UTF-8 text")]
    problems = []
    for number, line in enumerate(lines, start=1):
        entry = _CHECKSUM_LINE.fullmatch(line)
        if entry is None:
            if line.strip():
                problems.append(Problem("invalid_checksum_file", CHECKSUMS_FILE, f"line {number} "
                                        "is not '<sha256>  <file name>'"))
            continue
        name, expected = entry["name"], entry["digest"].lower()
        if classify(name) is not FileRole.FETCHED and not leaves_folder(name):
            continue  # a file the adapter is served without (README.md, training_args.bin)
        if name not in readable or name == CHECKSUMS_FILE:
            problems.append(Problem("invalid_checksum_file", CHECKSUMS_FILE, f"line {number} "
                                    f"lists {shown(name)}, which is not a file of the adapter"))
            continue
        actual = sha256.get(name) or _hash_file(folder / name)
        if actual.lower() != expected:
            problems.append(Problem("checksum_mismatch", name, f"SHA-256 is {actual.lower()}, "
                                    f"{CHECKSUMS_FILE} says {expected}"))
    return problems


def _hash_file(path: Path) -> str:
    return hash_file(path).sha256


# ---- results --------------------------------------------------------------------------------


def _bounded(problems: list[Problem]) -> list[Problem]:
    counts = Counter(p.code for p in problems)
    if all(n <= MAX_PROBLEMS_PER_CODE for n in counts.values()):
        return problems
    kept: list[Problem] = []
    seen: Counter[str] = Counter()
    for problem in problems:
        seen[problem.code] += 1
        if seen[problem.code] <= MAX_PROBLEMS_PER_CODE:
            kept.append(problem)
    for code, count in counts.items():
        if count > MAX_PROBLEMS_PER_CODE:
            kept.append(Problem(code, "", f"... and {count - MAX_PROBLEMS_PER_CODE} more "
                                "problems of this kind"))
    return kept


def summarize(problems: Sequence[Problem]) -> str:
    """One line for logs."""
    if not problems:
        return "valid"
    shown_problems = "; ".join(f"{p.code} {p.file or '.'}: {p.message}" for p in problems[:5])
    more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
    return f"{len(problems)} problem(s): {shown_problems}{more}"


def run_validate(path: Path, rules: Rules, *, as_json: bool, out: TextIO,
                 adapter_id: str | None = None) -> int:
    """The `validate` command: print the verdict on `out`; 0 when valid, 1 when not. Entries
    the engine never reads are a note (the sidecar leaves them out), not a problem. Under a
    signing policy the folder's signature is judged too, as a stage of `adapter_id` (default:
    the folder's name) would judge it."""
    verdict = judge_adapter(path, rules)
    problems = list(verdict.problems)
    facts: dict[str, object] = {}
    if rules.signing.rules:
        adapter_id = adapter_id or path.resolve().name
        rule = rules.signing.rule_for(adapter_id)
        signature = verify_folder(path, adapter_id, rule)
        problems += signature.problems
        facts = {"adapter_id": adapter_id, "rule": rule.describe(),
                 "signer": signature.signed.signer if signature.signed else None}
    if as_json:
        out.write(json.dumps({
            "path": str(path),
            "valid": not problems,
            "problems": [p.to_json() for p in problems],
            "ignored": list(verdict.ignored),
            **facts,
        }, indent=2) + "\n")
        return 1 if problems else 0
    for p in problems:
        out.write(f"{p.code}  {p.file or path}: {p.message}\n")
    if verdict.ignored:
        out.write(f"note  {len(verdict.ignored)} entries the engine never reads are left out "
                  f"(never fetched or published): {listed(verdict.ignored)}\n")
    if not problems:
        shown_facts = "".join(f" {key}={value}" for key, value in facts.items())
        out.write(f"OK {path}{shown_facts}\n")
    return 1 if problems else 0
