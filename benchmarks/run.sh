#!/usr/bin/env bash
# The benchmark in one command: builds the project's venv if needed, installs its own tools
# under benchmarks/.work, prints the table. Needs root for the shaped link's namespaces.
set -euo pipefail
cd "$(dirname "$0")/.."
make --no-print-directory .venv/.test-deps >/dev/null
exec .venv/bin/python -m benchmarks.bench "$@"
