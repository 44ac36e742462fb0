"""A trained head's folder: whose layout it is (ours or another toolkit's), its family, its draft sizes, and the
head itself loaded.

    folder = resolve_head_dir("runs/x")            # a training output folder's head/, or the folder itself
    head_source(folder)                            # "specheads", or the foreign format (export/foreign.FORMATS)
    head_kind(folder)                              # its family's name, the folder checked (config, weights)
    model = load_head(folder, target)              # the specheads model, unattached
    family(name).build_drafter(model, target, spec)   # the family's drafter over it (decoding/)
    dflash_block_size(folder), dspark_block_size(folder), peagle_depths(folder), mtp_steps(folder)

The one place that decides between our layout (``config.json`` with a ``model_type`` of ``specheads/families.py``)
and another toolkit's (``export/foreign.py``, read through the inverse of our export layouts): everything that
reads a head folder asks here.
"""

from __future__ import annotations

import json
from pathlib import Path

from specheads.errors import InputNotFoundError, UserError
from specheads.export.foreign import (check_format, foreign_block_size, foreign_depths, foreign_format,
                                      formats_looked_for, load_foreign_head, weight_files)
from specheads.families import FAMILIES, family, family_of_model_type, find

OURS = "specheads"  # ``head_source`` of a head trained here
HEAD_DIR_HINT = "give the output_dir of `specheads train` (holding head/) or its head/ folder"


def resolve_head_dir(path: str | Path) -> str:
    """A head folder, or a training output folder holding ``head/``."""
    p = Path(path)
    if (p / "head" / "config.json").exists():
        return str(p / "head")
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{p} holds no head (no config.json, nor head/config.json)")
    return str(p)


def head_source(head_dir: str | Path) -> str:
    """Where a head came from: ``specheads`` (trained here), or the format of a head trained elsewhere (a key of
    ``export.foreign.FORMATS``), read from its folder's config.json (a training output folder's ``head/`` first)."""
    p = Path(head_dir)
    folder = p / "head" if (p / "head" / "config.json").exists() else p
    return foreign_format(folder) or OURS


def head_config(head_dir: str | Path) -> dict:
    """The config.json of a head folder (or of a training output folder's ``head/``)."""
    return json.loads((Path(resolve_head_dir(head_dir)) / "config.json").read_text())


def head_model_type(head_dir: str) -> str | None:
    """The ``model_type`` of a head folder's config.json (None when it names none)."""
    return head_config(head_dir).get("model_type")


def head_kind(head_dir: str, setting: str = "head_dir") -> str:
    """The drafter family of a trained head, read from the ``model_type`` its trainer wrote in config.json (another
    toolkit's folder: from its format, ``export.foreign.check_format``); the folder must exist and hold the head's
    config and weights (checked before any target load). ``setting`` names the folder's setting in errors."""
    path = Path(head_dir).expanduser()
    if not path.is_dir():
        raise InputNotFoundError(f"{setting}={head_dir}: no such folder; {HEAD_DIR_HINT}")
    folder = path / "head" if (path / "head" / "config.json").is_file() else path
    config = folder / "config.json"
    if not config.is_file():
        raise InputNotFoundError(f"{setting}={head_dir} holds no head checkpoint (no config.json, nor head/config.json); "
                                 f"{HEAD_DIR_HINT}")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:
        raise UserError(f"{config} is not a readable head config ({e}); train the head again") from None
    kinds = {f.model_type: f.name for f in FAMILIES}
    foreign = foreign_format(folder)
    if model_type not in kinds and foreign is None:
        raise UserError(f"{setting}={head_dir}: {config} names model_type {model_type!r}, which is no head "
                        f"specheads trains ({', '.join(sorted(kinds))}), nor is it a head trained elsewhere "
                        f"({formats_looked_for()}); {HEAD_DIR_HINT}")
    if not weight_files(folder):
        raise InputNotFoundError(f"{setting}={head_dir}: {folder} holds config.json but no weights (*.safetensors, "
                                 "pytorch_model*.bin, medusa_lm_head.pt); the head was not saved completely: train it "
                                 "again (the same command resumes)")
    if foreign is not None:
        return check_format(folder)[1]  # a speculators head of another algorithm is refused here
    return kinds[model_type]


def check_head_kind(drafter: str, head_dir: str) -> None:
    """Refuse a head folder of another family than ``drafter`` (read from its config's ``model_type``)."""
    kind = head_model_type(head_dir)
    found = family_of_model_type(kind)
    if found is not None and found.name != drafter:
        raise UserError(f"{head_dir} holds a head of another family ({found.name}: model_type {kind}), not {drafter}: "
                        f"evaluate it with head_method={found.name}")


def load_head(head_dir: str | Path, target, expect: str | None = None):
    """The specheads model a head folder holds, unattached, in the folder's dtype: ours through its family's
    ``from_pretrained``, another toolkit's read and checked against ``target`` (a loaded ``Target``:
    ``export.foreign.load_foreign_head``). ``expect``: the family the caller drafts with, refused when the folder
    names another (and the class used where our config names no family)."""
    folder = resolve_head_dir(head_dir)
    if expect is not None:
        check_head_kind(expect, folder)
    if head_source(folder) != OURS:
        return load_foreign_head(folder, target)
    mt = head_model_type(folder)
    fam = family_of_model_type(mt) or (family(expect) if expect is not None else None)
    if fam is None:
        raise UserError(f"{head_dir}: config.json names model_type {mt!r}, which is no head specheads trains "
                        f"({', '.join(f.model_type for f in FAMILIES)})")
    return fam.model_class().from_pretrained(folder)


def check_adapted_target(model, head_dir: str | Path, target) -> None:
    """A head that carries its adapted target (Medusa-2: ``adapted_target`` in its config) must be verified by it."""
    adapted = getattr(model.config, "adapted_target", None)
    if adapted:
        want = (Path(head_dir) / adapted).resolve()
        if Path(str(target.name)).resolve() != want:
            raise ValueError(f"these Medusa-2 heads were trained with an adapted target at {want}; evaluate them "
                             f"with target.name_or_path={want} (got target '{target.name}')")


def verifier_for(head_method: str | None, head_dir: str | None) -> str | None:
    """The target a head must be verified by, when the head dictates it: Medusa-2 heads carry their
    adapted target (``<head>/target``), which replaces the original from then on (plain decoding and
    the lossless check run on it too). None for every other head (and without a head)."""
    if find(head_method) is None or not head_dir:
        return None
    head = Path(resolve_head_dir(head_dir))
    adapted = head_config(head).get("adapted_target")
    if not adapted:
        return None
    path = head / adapted
    if not (path / "config.json").exists():
        raise InputNotFoundError(f"the Medusa-2 head {head} names its adapted target '{adapted}/' but {path} "
                                f"holds no model (config.json missing); re-save it with `specheads train`")
    return str(path.resolve())


def dflash_block_size(head_dir: str | Path, kind: str = "dflash") -> int:
    """B of a saved DFlash (``kind``: or DSpark) head, slot 0 the anchor and B-1 drafted tokens: our config's
    ``block_size``, another toolkit's as its loader defaults it (``export.foreign.foreign_block_size``)."""
    check_head_kind(kind, str(head_dir))
    cfg = head_config(head_dir)
    if head_source(head_dir) != OURS:  # z-lab's or speculators' folder, with their defaults
        return foreign_block_size(cfg)
    if "block_size" not in cfg:
        raise UserError(f"{head_dir}: its config.json names no block_size; is it a {family(kind).title} head?")
    return int(cfg["block_size"])


def peagle_depths(head_dir: str | Path) -> int:
    """K of a saved P-EAGLE head: the tokens one of its forwards drafts (our config's ``num_depths``, speculators'
    record of it: ``export.foreign.foreign_depths``)."""
    cfg = head_config(head_dir)
    if head_source(head_dir) != OURS:
        return foreign_depths(cfg)
    if cfg.get("model_type") != family("peagle").model_type or "num_depths" not in cfg:
        raise UserError(f"{head_dir}: its config.json is not a P-EAGLE head's (model_type specheads_peagle, "
                        "num_depths)")
    return int(cfg["num_depths"])


def dspark_block_size(head_dir: str | Path) -> int:
    """B of a saved DSpark head (``dflash_block_size``: speculators' default 8 for its folder)."""
    return dflash_block_size(head_dir, "dspark")


def mtp_steps(head_dir: str | Path) -> int:
    """K of a saved MTP head: the recursive steps it was trained for (``num_steps`` in its config.json)."""
    return int(head_config(head_dir).get("num_steps", 1))
