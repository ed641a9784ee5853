"""Seed Triton's model repository into the cache volume from a read-only template (the one
shipped in the image or a ConfigMap), so the repository Triton loads can hold the catalog link
while the template stays read-only.

Only what differs is written, each file through a temporary name and a rename: a file Triton
already read keeps its modification time, because Triton reloads a model whose files changed.
"""

from __future__ import annotations

import filecmp
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

REPOSITORY_DIR = "model_repository"


def seed_model_repository(template: Path, target: Path) -> int:
    """Copy `template` into `target` (links copied as links); return how many entries were
    written. Raises OSError naming the path when the template cannot be read."""
    if not template.is_dir():
        raise OSError(f"the model repository template {template} is not a folder")
    written = 0
    for root, dirs, files in os.walk(template):
        source_dir = Path(root)
        relative = source_dir.relative_to(template)
        dest_dir = target / relative
        dest_dir.mkdir(parents=True, exist_ok=True)
        for name in [*dirs, *files]:
            source = source_dir / name
            if name == "__pycache__" or (source.is_dir() and not source.is_symlink()):
                continue
            if _copy_if_changed(source, dest_dir / name):
                written += 1
        dirs[:] = [d for d in dirs if d != "__pycache__" and not (source_dir / d).is_symlink()]
    if written:
        log.info("seeded model repository %s from %s: %d entries written", target, template,
                 written)
    return written


def _copy_if_changed(source: Path, dest: Path) -> bool:
    temporary = dest.with_name(f".{dest.name}.seeding")
    if source.is_symlink():
        link = os.readlink(source)
        if dest.is_symlink() and os.readlink(dest) == link:
            return False
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(link)
    else:
        if dest.is_file() and not dest.is_symlink() and filecmp.cmp(source, dest, shallow=False):
            return False
        shutil.copyfile(source, temporary)
        os.chmod(temporary, 0o644)
    os.replace(temporary, dest)
    return True
