"""Where the project's files are, for tests that read or run them."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
