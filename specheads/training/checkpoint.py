"""Training checkpoints: atomic on disk, checked on load, written in the background where that is safe.

A checkpoint is a folder ``<root>/step_0000120/`` holding what ``accelerator.save_state`` writes (model,
optimizer, registered scheduler, each process's RNG state; ZeRO shards under DeepSpeed) plus
``trainer_state.json`` (step, data position, counters) and ``manifest.json`` (size and SHA-256 of
every file). It is written under a temporary name, flushed to disk (fsync) and renamed only when
complete, so a run killed mid-save leaves the previous checkpoint as the latest one; a file changed
afterwards fails the manifest check with an error naming it, and ``train.resume=auto`` passes over such a
checkpoint to the newest intact one, with a warning (``resume_checkpoint``). ``trainer_state.json`` also records
the run's settings (method, target: ``TrainConfig.settings``), so a rerun with other ones is refused by name before
the target loads (``check_resume_settings``). The root must be on a file system all processes share.

``Checkpointer`` is the engine's writer. Synchronous, ``save`` returns once the checkpoint is on disk.
Asynchronous (``train.async_checkpoint``), training waits only while the model's and optimizer's
tensors are copied to CPU memory (pinned buffers, reused from save to save, on a GPU) and the small
files (RNG states, scheduler, scaler) are written by every rank; a background thread on the main
process then serialises the copies under accelerate's file names, fsyncs, hashes, renames and prunes.
The next save, the end of training and an exception wait for a write in flight; a failed write raises
at the next step. Only the main process writes model and optimizer under DDP or one process, so once
every rank's small files are written (a barrier) the main process alone finishes the checkpoint.
DeepSpeed's and FSDP's saves are collective (every rank gathers or writes its shards), so those runs
stay synchronous, and say so once.

What the model file holds: only what training changes (``saved_state``): parameters with ``requires_grad``,
every buffer (small; EAGLE-3's ``d2t``/``t2d`` are set at build time and kept rather than proved rebuilt) and any
extra state. Frozen parameters (Medusa's LM-head copies under ``train_lm_heads=false``, Medusa-2's whole target
under LoRA) are not written: the engine rebuilds the module from the target before it loads a checkpoint, and
``frozen.json`` holds a fingerprint of each frozen weight, so a resume whose build made different ones (another
target, seed or method setting) is refused by name instead of training on. Loading refuses a model file that
lacks a trained weight or holds a name the module does not have; a checkpoint written before this (the whole
state dict, frozen copies included) still loads. The optimizer's state covers the trained parameters only
(``make_optimizer``). Under DeepSpeed and FSDP the launcher writes the model itself (ZeRO or FSDP shards), so
those checkpoints still hold the whole module, frozen weights included (a log line says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from specheads.errors import ConfigError, InputNotFoundError, UserError
from specheads.training.config import ASYNC_CHECKPOINT

log = logging.getLogger(__name__)

FORMAT = "specheads.checkpoint/1"
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
FROZEN = "frozen.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# accelerate's save_state on these launchers is collective: every rank gathers or writes its part.
_COLLECTIVE = {"DEEPSPEED": "DeepSpeed's save is collective (every rank writes its ZeRO shards)",
               "FSDP": "FSDP's save is collective (every rank gathers or writes its shards)",
               "MEGATRON_LM": "Megatron-LM's save is collective", "XLA": "an XLA save syncs the device graph"}
# launchers that write the model themselves (not through a state dict this module can filter)
_OWN_MODEL_FILES = {"DEEPSPEED", "FSDP", "MEGATRON_LM"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read. A failed background write is one (it keeps its traceback: a full disk
    or a bug); what is wrong with a checkpoint on disk is one of the user errors below."""


class CorruptCheckpointError(CheckpointError, UserError):
    """A checkpoint on disk is incomplete, altered or unreadable (the message names the file)."""


class CheckpointMismatchError(CheckpointError, UserError):
    """A checkpoint was written by a run with other settings (method, target): it cannot resume this one."""


START_OVER = "give a new output_dir, or train.resume=never to train from step 0 here (its checkpoints are replaced)"


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
    _fsync(tmp)
    os.replace(tmp, folder / MANIFEST)


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_checkpoint(folder: str | Path) -> None:
    """Raise ``CorruptCheckpointError`` naming the first missing, truncated or altered file."""
    folder = Path(folder)
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        raise CorruptCheckpointError(f"{folder} has no {MANIFEST}: incomplete checkpoint (killed while saving?)")
    try:
        manifest = json.loads(manifest_file.read_text())
        entries = manifest["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CorruptCheckpointError(f"{manifest_file} is unreadable ({e}): corrupt checkpoint") from e
    for rel, want in entries.items():
        p = folder / rel
        if not p.is_file():
            raise CorruptCheckpointError(f"corrupt checkpoint {folder}: {rel} is missing")
        if p.stat().st_size != want["size"]:
            raise CorruptCheckpointError(f"corrupt checkpoint {folder}: {rel} has {p.stat().st_size} bytes, "
                                  f"manifest says {want['size']}")
        if _sha256(p) != want["sha256"]:
            raise CorruptCheckpointError(f"corrupt checkpoint {folder}: {rel} fails its SHA-256 check")


def save_checkpoint(accelerator, root: str | Path, step: int, state: dict[str, Any], keep: int = 2,
                    fingerprints: dict | None = None) -> Path:
    """Save everything needed to resume at optimizer step ``step`` and return once it is on disk; all
    processes must call this.

    ``state`` holds the engine's counters (JSON-serialisable). Keeps the newest ``keep`` checkpoints
    (``keep <= 0`` keeps all). ``fingerprints``: ``frozen_fingerprints(accelerator)`` taken earlier (frozen
    weights do not change), or None to take them now.
    """
    tmp, final = _begin(accelerator, root, step)
    hook = accelerator.register_save_state_pre_hook(_keep_saved_state)  # removed after this save
    try:
        accelerator.save_state(str(tmp))
    finally:
        hook.remove()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _publish(tmp, final, step, state, keep, fingerprints or frozen_fingerprints(accelerator))
        log.info("saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final


# --------------------------------------------------------------------------- what the model file holds


def _launcher(accelerator) -> str:
    return str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))


def frozen_keys(model: torch.nn.Module) -> set[str]:
    """Names of ``model.state_dict()``'s frozen parameters (``requires_grad`` False): rebuilt, not saved."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def saved_state(model: torch.nn.Module, state: dict) -> dict:
    """``state`` (``model``'s state dict) without its frozen parameters: what a checkpoint writes."""
    frozen = frozen_keys(model)
    return {k: v for k, v in state.items() if k not in frozen}


def _keep_saved_state(models, weights, output_dir) -> None:
    """``save_state`` pre-hook: each model's state dict (empty under DeepSpeed/FSDP) trimmed to ``saved_state``."""
    for i, (model, state) in enumerate(zip(models, weights)):
        weights[i] = saved_state(model, state)


def _fingerprint(t: torch.Tensor) -> list[float]:
    """[sum, sum of magnitudes] in float64, over chunks (no full-size float64 copy of a large weight)."""
    acc = torch.zeros(2, dtype=torch.float64, device=t.device)
    for chunk in t.detach().reshape(-1).split(1 << 24):
        chunk = chunk.double()
        acc[0] += chunk.sum()
        acc[1] += chunk.abs().sum()
    return acc.tolist()


def frozen_fingerprints(accelerator) -> dict[str, dict] | None:
    """``{model file: {key: {shape, dtype, sum}}}`` of every frozen weight the checkpoint leaves out; None where
    the launcher writes the model itself (the file then holds the frozen weights)."""
    if _launcher(accelerator) in _OWN_MODEL_FILES:
        return None
    out = {}
    for i, model in enumerate(accelerator._models):
        named = dict(model.named_parameters(remove_duplicate=False))
        out[_indexed("model.safetensors", i)] = {
            k: {"shape": list(named[k].shape), "dtype": str(named[k].dtype).removeprefix("torch."),
                "sum": _fingerprint(named[k])} for k in sorted(frozen_keys(model))}
    return out


def _check_frozen(accelerator, folder: Path) -> None:
    """Raise ``CheckpointMismatchError`` when a frozen weight this run built is not the one the checkpoint trained
    with."""
    if not (folder / FROZEN).is_file() or _launcher(accelerator) in _OWN_MODEL_FILES:
        return  # written before frozen weights were left out: the model file holds them
    saved = json.loads((folder / FROZEN).read_text())
    built = frozen_fingerprints(accelerator)
    for name, keys in saved.items():
        for k, want in keys.items():
            got = built.get(name, {}).get(k)
            if got is None:
                continue  # not frozen in this build: the model-file check has seen to it
            # the sums of the same weights agree to rounding, whatever device or chunking added them up
            tol = 1e-6 * max(want["sum"][1], got["sum"][1])
            same = ((got["shape"], got["dtype"]) == (want["shape"], want["dtype"])
                    and all(abs(x - y) <= tol for x, y in zip(want["sum"], got["sum"])))
            if not same:
                raise CheckpointMismatchError(
                    f"{folder}: frozen weight {k!r} is not the one this checkpoint was trained with (frozen weights "
                    f"are rebuilt from the target, not saved: resume with the same target, seed and method settings), "
                    f"or {START_OVER}")


def _check_model_keys(accelerator, folder: Path) -> None:
    """Raise ``CheckpointMismatchError`` naming a trained weight a model file lacks, a name no module has or a
    weight of another shape (a checkpoint written before the run's settings were recorded with it:
    ``check_resume_settings`` refuses a newer one before the target loads)."""
    from accelerate.utils.modeling import id_tensor_storage
    from safetensors import safe_open

    if _launcher(accelerator) in _OWN_MODEL_FILES:
        return
    for i, model in enumerate(accelerator._models):
        path = folder / _indexed("model.safetensors", i)
        if path.is_file():
            with safe_open(str(path), framework="pt") as f:
                shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        else:
            path = folder / _indexed("pytorch_model.bin", i)
            shapes = {k: list(v.shape) for k, v in torch.load(path, map_location="cpu", weights_only=True,
                                                               mmap=True).items()}
        names = set(shapes)
        state = model.state_dict()
        unknown = sorted(names - state.keys())
        if unknown:
            raise CheckpointMismatchError(f"{path} holds {unknown[0]!r}, which the module this run built does not "
                                          f"have (another method or method settings?): {START_OVER}")
        for k in sorted(names):
            if isinstance(state[k], torch.Tensor) and list(state[k].shape) != shapes[k]:
                raise CheckpointMismatchError(f"{path} holds {k!r} of shape {shapes[k]}, the module this run built "
                                              f"has {list(state[k].shape)} (other method settings or target?): "
                                              f"{START_OVER}")
        stored = {id_tensor_storage(state[k]) for k in names if isinstance(state[k], torch.Tensor)}
        frozen = frozen_keys(model)
        for k, v in state.items():  # a tied name is written once, under one of its names
            if k not in frozen and k not in names and not (isinstance(v, torch.Tensor) and id_tensor_storage(v) in stored):
                raise CheckpointMismatchError(f"{path} lacks the trained weight {k!r} (a checkpoint of another "
                                              f"method or method settings?): {START_OVER}")


def _begin(accelerator, root: str | Path, step: int) -> tuple[Path, Path]:
    """(empty temporary folder, final folder) of the checkpoint of ``step``, made by the main process."""
    final = checkpoint_path(root, step)
    tmp = final.parent / f".tmp_{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    return tmp, final


def _publish(tmp: Path, final: Path, step: int, state: dict[str, Any], keep: int, frozen: dict | None = None) -> None:
    """Main process, once every file is in ``tmp``: trainer state, frozen weights' fingerprints, fsync, manifest,
    rename, prune."""
    (tmp / STATE).write_text(json.dumps({"format": FORMAT, "step": step, **state}, indent=1))
    if frozen is not None:
        (tmp / FROZEN).write_text(json.dumps(frozen, indent=1))
    files = _files(tmp)
    for f in files + sorted({f.parent for f in files}):
        _fsync(f)
    write_manifest(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)  # the rename itself
    _prune(final.parent, keep)


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
    try:
        verify_checkpoint(folder)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{e}; resume from an intact checkpoint (train.resume=auto takes the newest), "
                                     f"or {START_OVER}") from None
    state = json.loads((folder / STATE).read_text())
    if state.get("format") != FORMAT:
        raise CheckpointMismatchError(f"{folder / STATE} has format {state.get('format')!r}, expected {FORMAT!r}: "
                                      f"{START_OVER}")
    _check_model_keys(accelerator, folder)
    _check_frozen(accelerator, folder)
    if _launcher(accelerator) in _OWN_MODEL_FILES:
        accelerator.load_state(str(folder))
    else:  # frozen weights are absent from the file: they stay as the build made them (checked above)
        accelerator.load_state(str(folder), strict=False)
    return state


def resume_checkpoint(root: str | Path, resume: str = "auto", verify_named: bool = True) -> Path | None:
    """The checkpoint a run resumes from (``train.resume``), verified. ``auto``: the newest intact one under ``root``;
    a newer corrupt one is passed over with a warning naming it (it stays on disk, untrusted, until training
    reaches its step again and replaces it), and a ``CorruptCheckpointError`` when every one is corrupt; None when
    there is none. ``never``: None. A folder: that one (verified unless ``verify_named`` is False: the engine's
    ``load_checkpoint`` verifies what it loads, and the recipe has verified it before the target loaded)."""
    if resume == "never":
        return None
    if resume != "auto":
        folder = Path(resume)
        if not folder.is_dir():
            raise InputNotFoundError(f"train.resume={resume}: no such checkpoint folder; use auto (the latest under "
                                     "output_dir/checkpoints), never, or a step_* folder there")
        if not verify_named:
            return folder
        try:
            verify_checkpoint(folder)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"train.resume={resume}: {e}; resume from an intact checkpoint "
                                         f"(train.resume=auto takes the newest), or {START_OVER}") from None
        return folder
    corrupt: list[CorruptCheckpointError] = []
    for folder in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(folder)
        except CorruptCheckpointError as e:
            corrupt.append(e)
            continue
        for e in corrupt:
            log.warning("%s: resuming from %s, the newest intact checkpoint, instead (the corrupt one is left as it "
                        "is, and replaced once training reaches its step)", e, folder.name)
        return folder
    if corrupt:
        raise CorruptCheckpointError(f"{corrupt[0]}, and no earlier checkpoint under {root} is intact to resume "
                                     f"from: {START_OVER}")
    return None


def check_resume_settings(folder: str | Path, settings: dict[str, Any], where: str) -> None:
    """Refuse, before the target loads, to resume from the checkpoint ``folder`` when the run that wrote it had other
    ``settings`` (``TrainConfig.settings``: the method's settings, the target) than this one; ``where`` names the
    folder for the user (``output_dir=runs/m1``). A checkpoint written without them is left to ``load_checkpoint``'s
    checks; a setting only one side has (a newer or older specheads) is not compared."""
    state_file = Path(folder) / STATE
    try:
        saved = json.loads(state_file.read_text()).get("settings")
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{state_file} is unreadable ({e}): corrupt checkpoint; {START_OVER}") from None
    if not saved:
        return
    was, now = _flat(saved), _flat(settings)
    differ = [f"{k}={_show(was[k])} there, {_show(now[k])} now" for k in now if k in was and not _same(was[k], now[k])]
    if differ:
        raise CheckpointMismatchError(f"{where}: checkpoint {Path(folder).name} was written by a run with other "
                                      f"settings ({'; '.join(differ)}), so it cannot resume this one: train with its "
                                      f"settings, or {START_OVER}")


def _flat(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"method": {"num_heads": 5}}`` -> ``{"method.num_heads": 5}`` (as the user writes the setting)."""
    out = {}
    for k, v in settings.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(value) -> str:
    """A setting's value as the command line writes it (null, true, [1, 2])."""
    return value if isinstance(value, str) else json.dumps(value)


def _same(a, b) -> bool:
    """Equal settings; two strings naming the same existing file or folder are (a relative and an absolute path)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    if a == b:
        return True
    if isinstance(a, str) and isinstance(b, str) and Path(a).expanduser().exists() and Path(b).expanduser().exists():
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    return False


# --------------------------------------------------------------------------- written in the background


def async_blocker(accelerator) -> str | None:
    """Why this run's checkpoints must be written synchronously (a launcher whose save is collective, a
    save-state hook, one copy per node), or None when a background write is safe."""
    kind = _launcher(accelerator)
    if kind in _COLLECTIVE:
        return _COLLECTIVE[kind]
    if accelerator._save_model_state_pre_hook:
        return "a save_state pre-hook is registered (it may change what is written)"
    if accelerator.project_configuration.save_on_each_node:
        return "save_on_each_node: every node's main process writes its own copy"
    return None


class Checkpointer:
    """The engine's checkpoint writer (see the module's docstring); every process makes one and calls
    ``save`` at the same steps.

    mode: ``auto`` writes in the background when the model trains on an accelerator (a GPU) and
    ``async_blocker`` finds nothing against it; a save whose CPU copy would take more than half of the
    available memory is then written in the training thread. On a CPU ``auto`` writes synchronously: the
    writer (serialisation, SHA-256) needs the cores and memory bandwidth the training steps use, and
    ``scripts/bench/bench_checkpoint.py`` measured the steps taken meanwhile slowed by as much time as the
    stall saved, or more. ``always`` writes in the background wherever it is safe (a ``ConfigError`` where it is
    not); ``never`` writes synchronously.
    """

    def __init__(self, accelerator, root: str | Path, keep: int = 2, mode: str = "auto"):
        if mode not in ASYNC_CHECKPOINT:
            raise ConfigError(f"train.async_checkpoint={mode}: use one of {', '.join(ASYNC_CHECKPOINT)}")
        blocker = async_blocker(accelerator)
        if mode == "always" and blocker:
            raise ConfigError(f"train.async_checkpoint=always: {blocker}, so checkpoints must be written "
                              "synchronously; use auto or never")
        self.acc, self.root, self.keep, self.mode = accelerator, Path(root), keep, mode
        self.asynchronous = mode == "always" or (mode == "auto" and blocker is None
                                                 and accelerator.device.type != "cpu")
        if blocker and mode == "auto" and accelerator.is_main_process:
            log.info("checkpoints are written synchronously (training waits for each): %s", blocker)
        if _launcher(accelerator) in _OWN_MODEL_FILES and accelerator.is_main_process:
            log.info("checkpoints hold the whole module, frozen weights included: %s writes the model itself",
                     _launcher(accelerator))
        self._frozen: dict | None = None  # the frozen weights' fingerprints (main process), taken at the first save
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._writing: Path | None = None
        self._pinned: dict[str, torch.Tensor] = {}  # reused host buffers of a GPU's tensors

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Checkpoint optimizer step ``step`` (``state``: the engine's counters, JSON-serialisable); returns
        the final folder, which exists once ``wait`` returns."""
        self.wait()
        if self.acc.is_main_process and self._frozen is None:
            self._frozen = frozen_fingerprints(self.acc)  # frozen weights do not change
        if not self.asynchronous:
            return save_checkpoint(self.acc, self.root, step, state, self.keep, self._frozen)
        acc = self.acc
        tmp, final = _begin(acc, self.root, step)
        start = time.perf_counter()
        copies, ready, copied = self._snapshot() if acc.is_main_process else ([], None, True)
        _save_small_files(acc, tmp)
        acc.wait_for_everyone()  # every rank's part is in tmp: the main process finishes alone
        if acc.is_main_process:
            job = (tmp, final, step, dict(state), self.keep, copies, ready, self._frozen)
            if not copied:
                _write(*job)
                log.info("saved checkpoint %s (in the training thread: no memory for a copy)", final)
                return final
            self._writing = final
            self._thread = threading.Thread(target=self._run, args=job, name=f"checkpoint-{step}")
            self._thread.start()
            log.info("checkpoint %s: state copied in %.2f s; writing in the background", final.name,
                     time.perf_counter() - start)
        return final

    def check(self) -> None:
        """Raise ``CheckpointError`` if a background write failed (cheap; the engine calls it every step)."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise CheckpointError(f"writing checkpoint {self._writing} failed in the background: "
                                  f"{type(failure).__name__}: {failure}") from failure

    def wait(self) -> None:
        """Block until a write in flight is on disk; raise ``CheckpointError`` if it failed."""
        if self._thread is not None:
            if self._thread.is_alive():
                log.info("waiting for checkpoint %s to finish writing", self._writing.name)
            self._thread.join()
            self._thread = None
        self.check()

    def close(self) -> None:
        """``wait`` for use while another error propagates: a failed write is logged, not raised."""
        try:
            self.wait()
        except CheckpointError as e:
            log.error("%s", e)

    def _run(self, *job) -> None:
        start = time.perf_counter()
        try:
            _write(*job)
        except BaseException as e:  # re-raised in the training thread by check()/wait()
            shutil.rmtree(job[0], ignore_errors=True)
            self._failure = e
            return
        log.info("saved checkpoint %s (written in %.1f s in the background)", job[1], time.perf_counter() - start)

    def _snapshot(self):
        """(files, ready, copied): ``[(file name, CPU copy, safetensors?)]`` of the model weights and optimizer
        states as ``save_state`` writes them, copied out of the live tensors; the CUDA event the copies wait
        on, or None; False when no copy was made (too little memory: the files hold the live state)."""
        acc, files = self.acc, []
        for i, model in enumerate(acc._models):  # accelerate keeps what save_state writes in these lists
            state = saved_state(model, acc.get_state_dict(model, unwrap=False))  # what save_state's hook keeps
            files.append((_indexed("model.safetensors", i), _without_aliases(state), True))
        for i, opt in enumerate(acc._optimizers):
            files.append((_indexed("optimizer.bin", i), opt.state_dict(), False))
        need = sum(_nbytes(obj) for _, obj, _ in files) - sum(_nbytes(b) for b in self._pinned.values())
        if self.mode == "auto" and not _fits(need):
            log.info("a checkpoint copy of %.1f GiB would take over half of the available memory: writing it in "
                     "the training thread", need / 2**30)
            return files, None, False
        copies = [(name, _copy(obj, self._pinned, name), safe) for name, obj, safe in files]
        ready = None
        if self._pinned:
            ready = torch.cuda.Event()
            ready.record()  # the writer waits for the device-to-host copies, training does not
        return copies, ready, True


def _save_small_files(acc, folder: Path) -> None:
    """Every rank: what ``save_state`` writes besides model and optimizer (schedulers, samplers, scaler, this
    rank's RNG state, registered objects), through accelerate's own functions, in the training thread."""
    from accelerate.checkpointing import save_accelerator_state, save_custom_state

    save_accelerator_state(str(folder), [], [], acc._schedulers, acc._dataloaders, acc.state.process_index,
                           acc.step, acc.scaler)
    for i, obj in enumerate(acc._custom_objects):
        save_custom_state(obj, str(folder), i)


def _write(tmp: Path, final: Path, step: int, state: dict, keep: int, copies, ready, frozen) -> None:
    if ready is not None:
        ready.synchronize()
    for name, obj, safe in copies:
        _write_file(tmp / name, obj, safe)
    _publish(tmp, final, step, state, keep, frozen)


def _write_file(path: Path, obj, safetensors: bool) -> None:
    """One file as ``save_state`` writes it (safetensors for weights, ``torch.save`` otherwise)."""
    from accelerate.utils import save

    save(obj, path, safe_serialization=safetensors)


def _indexed(name: str, i: int) -> str:
    """accelerate's name of the i-th model's or optimizer's file (``model_1.safetensors``)."""
    return name if i == 0 else name.replace(".", f"_{i}.", 1)


def _without_aliases(state: dict) -> dict:
    """A state dict with each shared storage once (as ``save`` writes safetensors), tensors contiguous."""
    from accelerate.utils.other import clean_state_dict_for_safetensors

    return clean_state_dict_for_safetensors(state)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _copy(obj, pinned: dict[str, torch.Tensor], key: str):
    """``obj`` (nested dicts, lists, tuples) with every tensor copied to CPU memory: into a reused pinned buffer
    (asynchronously) for a GPU's tensor, a fresh clone for a CPU one; other values kept (immutable ones)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if not t.is_cuda:
            return t.clone(memory_format=torch.contiguous_format)
        buf = pinned.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = pinned[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return buf.copy_(t, non_blocking=True)
    if isinstance(obj, dict):
        return {k: _copy(v, pinned, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy(v, pinned, f"{key}/{i}") for i, v in enumerate(obj))
    return obj


def _fits(nbytes: int) -> bool:
    """Whether ``nbytes`` is at most half of the memory the kernel reports available (True where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return True
    return nbytes <= kib * 1024 // 2
