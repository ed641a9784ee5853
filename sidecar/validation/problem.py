"""`Problem`: one reason an adapter is refused, as every check reports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Problem:
    code: str  # stable snake_case code, e.g. "rank_too_large"
    file: str  # file name inside the adapter folder, "" for the folder itself
    message: str

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "file": self.file, "message": self.message}
