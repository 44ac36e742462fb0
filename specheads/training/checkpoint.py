"""Training checkpoints: atomic on disk, checked on load.

A checkpoint is a folder ``<root>/step_0000120/`` written by ``accelerator.save_state`` (model,
optimizer, registered scheduler, each process's RNG state; ZeRO shards under DeepSpeed) plus
``trainer_state.json`` (step, data position, counters) and ``manifest.json`` (size and SHA-256 of
every file). It is written under a temporary name and renamed only when complete, so a run killed
mid-save leaves the previous checkpoint as the latest one; a file changed afterwards fails the
manifest check with an error naming it. The root must be on a file system all processes share.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT = "specheads.checkpoint/1"
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


def checkpoint_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:07d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root`` (those with a manifest), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> None:
    entries = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
               for p in _files(folder)}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "files": entries}, indent=1))
    os.replace(tmp, folder / MANIFEST)


def verify_checkpoint(folder: str | Path) -> None:
    """Raise ``CheckpointError`` naming the first missing, extra-truncated or altered file."""
    folder = Path(folder)
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"{folder} has no {MANIFEST}: incomplete checkpoint (killed while saving?)")
    try:
        manifest = json.loads(manifest_file.read_text())
        entries = manifest["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{manifest_file} is unreadable ({e}): corrupt checkpoint") from e
    for rel, want in entries.items():
        p = folder / rel
        if not p.is_file():
            raise CheckpointError(f"corrupt checkpoint {folder}: {rel} is missing")
        if p.stat().st_size != want["size"]:
            raise CheckpointError(f"corrupt checkpoint {folder}: {rel} has {p.stat().st_size} bytes, "
                                  f"manifest says {want['size']}")
        if _sha256(p) != want["sha256"]:
            raise CheckpointError(f"corrupt checkpoint {folder}: {rel} fails its SHA-256 check")


def save_checkpoint(accelerator, root: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Save everything needed to resume at optimizer step ``step``; all processes must call this.

    ``state`` holds the engine's counters (JSON-serialisable). Keeps the newest ``keep`` checkpoints
    (``keep <= 0`` keeps all).
    """
    root = Path(root)
    final = checkpoint_path(root, step)
    tmp = root / f".tmp_{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE).write_text(json.dumps({"format": FORMAT, "step": step, **state}, indent=1))
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(root, keep)
        log.info("saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def remove_partial(root: str | Path) -> None:
    """Delete temporary folders left by a save that was killed (main process only)."""
    root = Path(root)
    if root.is_dir():
        for p in root.glob(".tmp_step_*"):
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(accelerator, folder: str | Path) -> dict[str, Any]:
    """Verify ``folder``, restore model/optimizer/scheduler/RNG into ``accelerator``; return the engine state."""
    folder = Path(folder)
    verify_checkpoint(folder)
    state = json.loads((folder / STATE).read_text())
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{folder / STATE} has format {state.get('format')!r}, expected {FORMAT!r}")
    accelerator.load_state(str(folder))
    return state
