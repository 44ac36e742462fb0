"""Reading a saved head folder and checking its tensors against a layout, before an export writes anything.

    cfg, header, files = read_head("runs/x/train/eagle3/head")
    float_code = check_tensors(header, head_tensors(method_of(cfg), cfg), "head runs/x/...")  # e.g. "F32"

A header is ``{tensor name: (shape, safetensors dtype code)}``, read without loading the tensors. Every check
fails with an ``ExportError`` naming the file and the offending key.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specheads.errors import SpecheadsError
from specheads.export.layouts import FLOAT, TargetInfo, TensorSpec

WEIGHTS = "model.safetensors"
FLOAT_CODES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
OTHER_CODES = {"int64": "I64", "bool": "BOOL"}


class ExportError(SpecheadsError, ValueError):
    """The head folder, the target or the requested export does not fit; the message says where."""


def read_head(head_dir: str | Path) -> tuple[dict, dict[str, tuple[tuple[int, ...], str]], list[Path]]:
    """(config.json contents, {tensor name: (shape, safetensors dtype code)}, weight files) of a head folder."""
    head = Path(head_dir)
    cfg_path = head / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{head} holds no config.json: not a saved head folder (expected <train output_dir>/head)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{cfg_path} is not valid JSON: {e}") from e
    files = weight_files(head)
    return cfg, read_header(files), files


def read_header(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, safetensors dtype code such as ``"F32"``)} over safetensors files, without loading them."""
    header: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name in header:
                    raise ExportError(f"tensor {name!r} appears in two weight files ({f})")
                sl = sf.get_slice(name)
                header[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return header


def weight_files(folder: Path) -> list[Path]:
    index = folder / f"{WEIGHTS}.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = [folder / WEIGHTS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ExportError(f"weight file(s) {missing} missing in {folder}")
    return files


def check_tensors(header: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, TensorSpec],
                  where: str) -> str:
    """Strict check of a file's tensors against a layout; returns the float dtype code (e.g. ``"F32"``).

    Every expected name must be present with its shape and dtype kind, no other name may be present,
    and all float tensors must share one dtype. Errors name the offending keys.
    """
    missing = sorted(set(expected) - set(header))
    unknown = sorted(set(header) - set(expected))
    if missing or unknown:
        parts = ([f"missing key(s) {missing}"] if missing else []) + ([f"unknown key(s) {unknown}"] if unknown else [])
        raise ExportError(f"{where}: {'; '.join(parts)}")
    float_codes = set()
    for name, spec in expected.items():
        shape, code = header[name]
        if shape != spec.shape:
            raise ExportError(f"{where}: key {name!r} has shape {list(shape)}, expected {list(spec.shape)}")
        if spec.dtype == FLOAT:
            if code not in FLOAT_CODES:
                raise ExportError(f"{where}: key {name!r} has dtype {code}, expected a float dtype")
            float_codes.add(code)
        elif code != OTHER_CODES[spec.dtype]:
            raise ExportError(f"{where}: key {name!r} has dtype {code}, expected {OTHER_CODES[spec.dtype]}")
    if len(float_codes) > 1:
        raise ExportError(f"{where}: float tensors mix dtypes {sorted(float_codes)}")
    return float_codes.pop() if float_codes else "F32"


def check_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """``arange(V_draft) + d2t`` must list exactly the target ids that ``t2d`` marks, ascending."""
    ids = torch.arange(d2t.numel()) + d2t
    marked = t2d.nonzero().flatten()
    if ids.numel() != marked.numel() or not torch.equal(ids, marked):
        raise ExportError(f"{where}: d2t and t2d disagree (arange + d2t must equal t2d.nonzero()); "
                          "the draft vocabulary was never set (Eagle3Model.set_draft_vocab) or is corrupt")


def adapted_target(head: Path, cfg: dict, target: TargetInfo) -> Path | None:
    """The Medusa-2 merged adapted target folder inside the head folder (checked), or None."""
    rel = cfg.get("adapted_target")
    if not rel:
        return None
    folder = head / rel
    if not (folder / "config.json").is_file():
        raise ExportError(f"the heads name an adapted target in {folder}, but it holds no config.json; "
                          "Medusa-2 heads must be exported together with the target they were trained with")
    tcfg = json.loads((folder / "config.json").read_text())
    weight_files(folder)
    for key, want in (("hidden_size", cfg["hidden_size"]), ("vocab_size", cfg["vocab_size"]),
                      ("num_hidden_layers", target.num_layers)):
        if want is not None and tcfg.get(key) != want:
            raise ExportError(f"adapted target {folder}: {key} {tcfg.get(key)} does not match {want}")
    return folder
