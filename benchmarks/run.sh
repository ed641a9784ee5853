#!/usr/bin/env bash
# The benchmark in one command: builds the project's venv if needed, installs its own tools
# under benchmarks/.work, prints the table. `--help` (prerequisites, how long it takes) and the
# prerequisite check answer first, before anything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="$(command -v python3.11 || command -v python3)"
if [ "${1:-}" = "policy" ]; then  # the eviction policies on traces: needs no S3 server, no root
    shift
    make --no-print-directory .venv/.test-deps >/dev/null
    exec .venv/bin/python -m benchmarks.policy "$@"
fi
for arg in "$@"; do
    case "$arg" in
        -h|--help) exec "$PYTHON" -m benchmarks.options --help ;;
    esac
done
"$PYTHON" -m benchmarks.options --check "$@"
echo "[$(date +%H:%M:%S)] building the project's venv with its test extras (first run only)" >&2
make --no-print-directory .venv/.test-deps >/dev/null
exec .venv/bin/python -m benchmarks.bench "$@"
