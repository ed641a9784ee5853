"""Adapter folders as people have them, written without the network: what
`hf download REPO --local-dir DIR` (huggingface_hub 0.36) and a PEFT + Trainer run leave beside
the adapter's two files."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from sidecar.process.examples import write_adapter

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def write_hf_download(folder: Path, *, seed: int = 0, rank: int = 8) -> None:
    """An adapter repository downloaded with `hf download --local-dir`: the repo's files
    (README.md, .gitattributes) and huggingface_hub's `.cache/huggingface/` (a .gitignore, and a
    .metadata file per downloaded file, with the .lock files it leaves behind)."""
    write_adapter(folder, seed=seed, rank=rank)
    (folder / "README.md").write_text("---\nlibrary_name: peft\nbase_model: tiny-llama\n---\n")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    hub = folder / ".cache" / "huggingface"
    (hub / "download").mkdir(parents=True)
    (hub / ".gitignore").write_text("*")
    for name in (CONFIG, WEIGHTS, "README.md", ".gitattributes"):
        (hub / "download" / f"{name}.metadata").write_text(
            f"{'0' * 40}\n{'e' * 64}\n1767225600.0\n")
        (hub / "download" / f"{name}.lock").write_bytes(b"")


def write_trainer_output(folder: Path, *, seed: int = 0, rank: int = 8) -> None:
    """A Trainer's output_dir after `trainer.save_model()` of a PEFT model: the adapter, the
    tokenizer saved beside it, the pickled TrainingArguments, a model card, and a checkpoint
    folder with the optimizer state (every .bin/.pt/.pth here a real pickle)."""
    write_adapter(folder, seed=seed, rank=rank)
    arguments = pickle.dumps({"output_dir": str(folder), "learning_rate": 2e-4})
    (folder / "training_args.bin").write_bytes(arguments)
    (folder / "README.md").write_text("---\nlibrary_name: peft\n---\n# Model Card\n")
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    write_trainer_checkpoint(folder / "checkpoint-500", seed=seed, rank=rank)


def write_trainer_checkpoint(folder: Path, *, seed: int = 0, rank: int = 8) -> None:
    """One `checkpoint-N/` folder of a Trainer run of a PEFT model, as it is saved: the adapter
    with the optimizer's, scheduler's and random generators' states and the trainer's."""
    write_adapter(folder, seed=seed, rank=rank)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        (folder / name).write_bytes(pickle.dumps({"state": name}))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 500}))


def files_below(folder: Path) -> dict[str, bytes]:
    """Every file below `folder`, by its '/'-separated path: what `aws s3 sync` or
    `mc cp --recursive` would upload as keys."""
    return {path.relative_to(folder).as_posix(): path.read_bytes()
            for path in sorted(folder.rglob("*")) if path.is_file()}
