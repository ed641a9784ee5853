"""The real engine for tests: its environment (created by scripts/engine-env.sh), the stock
Triton vLLM backend, a tiny Llama with PEFT adapters built on the spot (nothing downloaded),
reference texts from transformers + peft, and Triton started with the real backend.

The engine's Python packages live in their own virtual environment (~8 GB); this module runs in
the test venv and reaches them only through subprocesses (tests/engine/worker.py, tritonserver's
Python backend stub).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.validation.shapes import ModelShapes

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"
REQUIREMENTS = REPO_ROOT / "engine" / "requirements.txt"
ENV_SCRIPT = REPO_ROOT / "scripts" / "engine-env.sh"
CHECKED_IN_ENGINE_ARGS = REPO_ROOT / "triton_repo" / "vllm_model" / "1" / "model.json"
BACKEND_TAG = "r26.01"
BACKEND_REPO = "https://github.com/triton-inference-server/vllm_backend.git"
BACKEND_CLONE_TIMEOUT_S = 30.0
VENDORED_BACKEND = REPO_ROOT.parent / "shared" / "vendor" / "vllm_backend"

# The base model every engine test serves: a random Llama small enough for a 2-core CPU, with
# vLLM's CPU attention (head sizes of 32 and up).
ENGINE_MODEL = ModelShapes(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    head_dim=32,
)
MODEL_SEED = 0
MAX_POSITION_EMBEDDINGS = 512
PROMPT = "Tell me about tenants: "
MAX_TOKENS = 16
MAX_LORA_RANK = 16  # as the checked-in model.json and the sidecar's default --max-lora-rank

# The good adapters every run builds with PEFT itself: the kinds the gate must accept.
GOOD_ADAPTERS: Mapping[str, Mapping[str, Any]] = {
    "f32-qv": {"seed": 1, "target_modules": ["q_proj", "v_proj"]},
    "f16-qv": {"seed": 2, "target_modules": ["q_proj", "v_proj"], "dtype": "float16"},
    "bf16-qv": {"seed": 3, "target_modules": ["q_proj", "v_proj"], "dtype": "bfloat16"},
    "rslora": {"seed": 4, "target_modules": ["q_proj", "v_proj"], "use_rslora": True},
    "attention": {"seed": 5, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "all-linear": {"seed": 6, "target_modules": "all-linear", "r": 16, "lora_alpha": 8},
    "extra-files": {"seed": 7, "target_modules": ["q_proj", "v_proj"],
                    "extra_files": {"LICENSE": "Apache-2.0\n", "README": "a tenant's adapter\n"}},
    # Four more tenants of the plainest kind, for tests that need many adapters.
    **{f"tenant-{n}": {"seed": 20 + n, "target_modules": ["q_proj", "v_proj"],
                       "dtype": "float16"} for n in range(4)},
}

# Adapters PEFT builds that the engine of this release serves wrongly or not at all, or that
# test a rule of the gate on PEFT's own files; the gate corpus judges them.
PEFT_CASES: Mapping[str, Mapping[str, Any]] = {
    "peft_rank_pattern": {"seed": 30, "target_modules": ["q_proj", "v_proj"],
                          "rank_pattern": {"q_proj": 4}},
    "peft_alpha_pattern": {"seed": 31, "target_modules": ["q_proj", "v_proj"],
                           "alpha_pattern": {"v_proj": 64}},
    "peft_lora_bias": {"seed": 32, "target_modules": ["q_proj", "v_proj"], "lora_bias": True},
    "peft_regex_targets": {"seed": 33, "target_modules": r".*\.(q_proj|v_proj)"},
    "peft_layers_to_transform": {"seed": 34, "target_modules": ["q_proj", "v_proj"],
                                 "layers_to_transform": [1]},
}

# What the engine runs with in tests: the checked-in model.json, with only the model path and
# the sizes changed for a 2-core CPU (engine_args()).
CPU_ENGINE_SIZES: Mapping[str, Any] = {
    "max_loras": 2,
    "max_cpu_loras": 2,  # small, so adapters are read from disk again as they come and go
    "max_model_len": MAX_POSITION_EMBEDDINGS,
    "max_num_seqs": 16,
    "dtype": "float32",
    "enforce_eager": True,
}
CPU_DROPPED_ARGS = ("gpu_memory_utilization",)
ENGINE_ENV: Mapping[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "OMP_NUM_THREADS": "2",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


class EngineUnavailable(RuntimeError):
    """The engine environment or the stock backend cannot be had; the message says how to fix."""


# ---- the engine environment ------------------------------------------------------------------


@dataclass(frozen=True)
class EngineEnv:
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a process of the engine's: its venv first on PATH, a developer's
        own AWS and sidecar settings left out."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("LORA_SIDECAR_", "AWS_", "VIRTUAL_ENV", "PYTHON"))}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.update(ENGINE_ENV)
        env.update(extra or {})
        return env

    def libdir(self) -> str:
        out = subprocess.run([str(self.python), "-c",
                              "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                             check=True, capture_output=True, text=True, timeout=60)
        return out.stdout.strip()

    def run_worker(self, command: str, spec: Mapping[str, Any], out: Path, *,
                   timeout_s: float, log: Path) -> None:
        """tests/engine/worker.py in the engine venv, in a session of its own: whatever it
        started (vLLM's EngineCore) is ended with it."""
        spec_path = out.parent / f".{out.name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        with log.open("ab") as sink:
            process = subprocess.Popen(
                [str(self.python), str(WORKER), command, str(spec_path), str(out)],
                stdout=sink, stderr=subprocess.STDOUT, env=self.environ(),
                start_new_session=True,
            )
            try:
                code = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                kill_session(process.pid)
        if code != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"engine worker {command} failed ({code}); {log}:\n{tail}")


def engine_venv_path() -> Path:
    return Path(os.environ.get("LORA_ENGINE_VENV") or REPO_ROOT / ".engine-venv")


def ensure_engine_env() -> EngineEnv:
    """The engine environment, built by scripts/engine-env.sh when it is missing or stale (the
    script returns at once when its stamp matches)."""
    venv = engine_venv_path()
    result = subprocess.run([str(ENV_SCRIPT)], env={**os.environ, "LORA_ENGINE_VENV": str(venv)},
                            capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise EngineUnavailable(f"scripts/engine-env.sh failed to build {venv} "
                                f"(exit {result.returncode}):\n{result.stderr[-3000:]}")
    return EngineEnv(venv)


def kill_session(leader: int) -> None:
    """SIGKILL every process left in a session a test started (tritonserver's stubs, vLLM's
    EngineCore children that outlived their parent)."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- the stock backend ---------------------------------------------------------------------


@dataclass
class BackendLookup:
    path: Path | None
    tried: list[str] = field(default_factory=list)

    def fix(self) -> str:
        return ("Set TRITON_VLLM_BACKEND_DIR to a folder holding the stock backend's model.py "
                f"and utils/ (triton-inference-server/vllm_backend, tag {BACKEND_TAG}, src/), "
                "or place it at ../shared/vendor/vllm_backend/src next to the repository, or "
                "let this machine reach GitHub for a clone.")


def _backend_in(folder: Path) -> Path | None:
    for candidate in (folder, folder / "src"):
        if (candidate / "model.py").is_file() and (candidate / "utils").is_dir():
            return candidate
    return None


def find_vllm_backend(clone_into: Path, vendored: Path = VENDORED_BACKEND,
                      repository: str = BACKEND_REPO) -> BackendLookup:
    """Where a user would have the stock backend: TRITON_VLLM_BACKEND_DIR, then the vendored
    copy beside the repository, then a shallow clone of the tag (bounded in time)."""
    lookup = BackendLookup(None)
    named = os.environ.get("TRITON_VLLM_BACKEND_DIR")
    if named:
        found = _backend_in(Path(named))
        lookup.tried.append(f"TRITON_VLLM_BACKEND_DIR={named}: "
                            + ("found" if found else "no model.py and utils/ there"))
        if found:
            lookup.path = found
            return lookup
    else:
        lookup.tried.append("TRITON_VLLM_BACKEND_DIR: not set")
    found = _backend_in(vendored)
    lookup.tried.append(f"{vendored}: " + ("found" if found else "absent"))
    if found:
        lookup.path = found
        return lookup
    target = clone_into / "vllm_backend"
    if _backend_in(target) is None:
        shutil.rmtree(target, ignore_errors=True)
        try:
            result = subprocess.run(
                ["git", "clone", "--quiet", "--depth", "1", "--branch", BACKEND_TAG,
                 repository, str(target)],
                capture_output=True, text=True, timeout=BACKEND_CLONE_TIMEOUT_S,
                env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
            )
            detail = result.stderr.strip().splitlines()[-1:] if result.returncode else []
            outcome = f"exit {result.returncode} {' '.join(detail)}".strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        lookup.tried.append(f"git clone --branch {BACKEND_TAG} {repository}: {outcome}")
    lookup.path = _backend_in(target)
    return lookup


# ---- the tiny model, good adapters, reference texts --------------------------------------


@dataclass(frozen=True)
class Reference:
    """What transformers + peft generate for base + adapter (greedy). `fits` is false when the
    adapter cannot be applied whole to the base model or its logits are not finite: no text
    served for it can be right."""

    fits: bool
    text: str | None
    reason: str

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Reference:
        return cls(bool(value["fits"]), value.get("text"), str(value.get("reason", "")))


def model_spec() -> dict[str, Any]:
    return {
        "seed": MODEL_SEED,
        "hidden_size": ENGINE_MODEL.hidden_size,
        "intermediate_size": ENGINE_MODEL.intermediate_size,
        "num_hidden_layers": ENGINE_MODEL.num_hidden_layers,
        "num_attention_heads": ENGINE_MODEL.num_attention_heads,
        "num_key_value_heads": ENGINE_MODEL.num_key_value_heads,
        "head_dim": ENGINE_MODEL.head_dim,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
    }


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:20]


def folder_digest(folder: Path) -> str:
    """The content of an adapter folder (names and bytes), for caching what depends on it."""
    parts: list[bytes] = []
    for path in sorted(folder.iterdir()):
        parts.append(path.name.encode())
        parts.append(os.readlink(path).encode() if path.is_symlink()
                     else path.read_bytes() if path.is_file() else b"<dir>")
    return _digest(*parts)


@dataclass
class EngineAssets:
    """The base model, the good adapters and their reference texts of one test session; built
    once per content (cached across sessions in pytest's cache folder)."""

    env: EngineEnv
    root: Path
    cache: Path  # where reference texts of other folders are kept, by content

    @property
    def base(self) -> Path:
        return self.root / "base"

    @property
    def base_config(self) -> Path:
        return self.base / "config.json"

    def adapter(self, name: str) -> Path:
        return self.root / "adapters" / name

    @property
    def good_adapters(self) -> dict[str, Path]:
        return {name: self.adapter(name) for name in GOOD_ADAPTERS}

    def reference(self, name: str) -> Reference:
        """The reference of a good adapter (or "base")."""
        data = json.loads((self.root / "references.json").read_text())
        return Reference.from_json(data[name])

    def text(self, name: str) -> str:
        reference = self.reference(name)
        assert reference.fits and reference.text is not None, reference
        return reference.text

    def references(self, folders: Mapping[str, Path], *, prompt: str = PROMPT,
                   max_tokens: int = MAX_TOKENS) -> dict[str, Reference]:
        """Reference texts of any adapter folders (transformers + peft in the engine venv), kept
        by content, so a rerun costs nothing."""
        keys = {name: _digest(folder_digest(folder).encode(), prompt.encode(),
                              str(max_tokens).encode(), WORKER.read_bytes())
                for name, folder in folders.items()}
        self.cache.mkdir(parents=True, exist_ok=True)
        missing = {name: str(folders[name]) for name, key in keys.items()
                   if not (self.cache / f"{key}.json").exists()}
        if missing:
            out = self.cache / f"batch-{os.getpid()}.json"
            self.env.run_worker("references", {"base": str(self.base), "adapters": missing,
                                               "prompt": prompt, "max_tokens": max_tokens},
                                out, timeout_s=600, log=self.cache / "worker.log")
            for name, value in json.loads(out.read_text()).items():
                (self.cache / f"{keys[name]}.json").write_text(json.dumps(value))
            out.unlink()
        return {name: Reference.from_json(json.loads((self.cache / f"{key}.json").read_text()))
                for name, key in keys.items()}


def assets_spec() -> dict[str, Any]:
    return {"model": model_spec(), "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "peft_adapters": {**GOOD_ADAPTERS, **PEFT_CASES}}


def build_assets(env: EngineEnv, cache_root: Path) -> EngineAssets:
    """Build (or find, by content) the session's base model, good adapters and references."""
    spec = assets_spec()
    key = _digest(json.dumps(spec, sort_keys=True).encode(), WORKER.read_bytes(),
                  REQUIREMENTS.read_bytes())
    root = cache_root / f"assets-{key}"
    if not (root / "references.json").exists():
        cache_root.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix="assets-", dir=cache_root))
        env.run_worker("assets", spec, building, timeout_s=900,
                       log=cache_root / "worker.log")
        shutil.rmtree(root, ignore_errors=True)
        building.rename(root)
    return EngineAssets(env, root, cache_root / "references")


# ---- the engine in Triton -------------------------------------------------------------------


def engine_args(base: Path, **overrides: Any) -> dict[str, Any]:
    """The checked-in vllm_model/1/model.json with the model path and the engine sizes of a
    2-core CPU; everything else (enable_lora, max_lora_rank, ...) as checked in."""
    args: dict[str, Any] = json.loads(CHECKED_IN_ENGINE_ARGS.read_text())
    for name in CPU_DROPPED_ARGS:
        args.pop(name, None)
    args.update(CPU_ENGINE_SIZES)
    args["model"] = str(base)
    args.update(overrides)
    return args


def install_stock_backend(source: Path, dest: Path) -> None:
    """The stock backend's files, copied byte for byte, as backend `vllm`."""
    dest.mkdir(parents=True)
    shutil.copy2(source / "model.py", dest / "model.py")
    shutil.copytree(source / "utils", dest / "utils",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def engine_processes(leader: int) -> dict[int, str]:
    """Processes of a session named like vLLM's engine children (VLLM::EngineCore, ...), with
    their names."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if int(fields[3]) == leader and "VLLM" in comm:  # fields[3]: the session id
            found[int(entry.name)] = comm.strip()
    return found


def tree_rss_bytes(pids: Iterable[int]) -> int:
    """Resident memory of processes and all their descendants (for the peak-memory figure)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            status = (entry / "status").read_text()
        except OSError:
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss[pid] = int(line.split()[1]) * 1024
    total, stack, seen = 0, list(pids), set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total
