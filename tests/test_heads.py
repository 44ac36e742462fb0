"""The head loader (``specheads/heads.py``): one decision between our layout and another toolkit's, the family read
from the folder, the draft sizes read once, on tiny random heads."""

from __future__ import annotations

import json

import pytest

from specheads.errors import InputNotFoundError, UserError
from specheads.heads import (check_head_kind, dflash_block_size, head_kind, head_source, load_head, mtp_steps,
                             peagle_depths, resolve_head_dir, verifier_for)
from specheads.targets import Target
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def target():
    return Target(make_tiny_model(vocab=128, hidden=32, layers=2, seed=0), tokenizer=None, name="tiny")


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """Training output folders (head/ inside) of Medusa and EAGLE-1, and a DFlash head folder."""
    from specheads.models.dflash import DFlashConfig, DFlashModel
    from specheads.models.eagle1 import Eagle1Config, Eagle1Model
    from specheads.models.medusa import medusa_for_target

    root = tmp_path_factory.mktemp("heads")
    medusa_for_target(target, num_heads=2).save_pretrained(root / "medusa" / "head")
    Eagle1Model(Eagle1Config.from_target(target)).save_pretrained(root / "eagle1" / "head")
    DFlashModel(DFlashConfig.from_target(target, block_size=5, aux_layers=(0, 1))).save_pretrained(root / "dflash")
    return root


def test_ours_is_read_by_its_family(heads, target):
    assert resolve_head_dir(heads / "eagle1") == str(heads / "eagle1" / "head")
    for family, cls in (("medusa", "MedusaHeads"), ("eagle1", "Eagle1Model"), ("dflash", "DFlashModel")):
        assert head_source(heads / family) == "specheads" and head_kind(str(heads / family)) == family
        assert type(load_head(heads / family, target)).__name__ == cls
    assert dflash_block_size(heads / "dflash") == 5
    assert verifier_for("eagle1", str(heads / "eagle1")) is None and verifier_for(None, None) is None


def test_another_family_or_no_head_is_refused(heads, target, tmp_path):
    with pytest.raises(UserError, match=r"another family \(eagle1"):
        load_head(heads / "eagle1", target, expect="medusa")
    with pytest.raises(UserError, match=r"another family \(medusa"):
        check_head_kind("dflash", str(heads / "medusa"))
    with pytest.raises(InputNotFoundError, match="no such folder"):
        head_kind(str(tmp_path / "nothing"))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "specheads_unknown"}))
    with pytest.raises(UserError, match="specheads_unknown"):
        load_head(tmp_path / "odd", target)
    with pytest.raises(UserError, match="specheads_unknown"):
        head_kind(str(tmp_path / "odd"))


def test_draft_sizes_of_another_toolkit_s_folders(tmp_path):
    """K and B as the other toolkits' loaders default them when their folder writes none."""
    def folder(name, cfg):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return tmp_path / name

    zlab = folder("zlab", {"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 3}})
    spec = folder("spec", {"speculators_model_type": "dflash"})
    peagle = folder("peagle", {"speculators_model_type": "peagle",
                               "speculators_config": {"proposal_methods": [{"speculative_tokens": 6}]}})
    assert head_source(zlab) == "dflash" and dflash_block_size(zlab) == 16 and dflash_block_size(spec) == 8
    assert peagle_depths(peagle) == 6
    assert mtp_steps(folder("mtp", {"model_type": "specheads_mtp", "num_steps": 3})) == 3
