"""NVIDIA ModelOpt 0.47's DFlash and DSpark exports as specheads/export/foreign.py reads them, without ModelOpt: folders
written the way its ``DFlashExporter`` and ``DSparkExporter`` write them (modelopt/torch/export/plugins/
hf_spec_export.py). A DFlash export is z-lab's format, with ``num_target_layers`` 0 after an offline run; DSpark's and
Domino's are refused by name. (A real ModelOpt export against ModelOpt's forward: tests/test_compare_modelopt.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specheads.export.foreign import foreign_format, load_foreign_head, read_foreign_head
from specheads.models.dflash import DFlashModel
from tests.export.test_export import H, V
from tests.export.test_foreign import _edit_config, assert_refused
from tests.export.test_foreign_families import INFO, MASK, _edit_weights, assert_same_state, dflash_head
from tests.export.test_foreign_families import target  # noqa: F401  (the module's tiny target, a fixture)


def modelopt_folder(root: Path, head: DFlashModel, **config) -> Path:
    """``export_speculative_decoding`` of ModelOpt 0.47's offline DFlash: ``DFlashExporter._export_config``'s keys
    (``num_target_layers`` the base config's layer count, 0 once its offline loader dropped the layers;
    ``dflash_config.causal`` false for bidirectional blocks; ``torch_dtype`` the base model's) and the draft module's
    state dict without its ``dflash_module.`` prefix or rotary buffers, in the trained dtype."""
    root.mkdir(parents=True)
    c = head.config
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": c.block_size,
           "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [i - 1 for i in c.aux_layers],
                             "causal": False},
           "hidden_size": H, "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
           "intermediate_size": c.intermediate_size, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
           "vocab_size": V, "max_position_embeddings": 512, "initializer_range": 0.02, "attention_bias": False,
           "attention_dropout": 0.0, "rope_theta": c.rope_parameters["rope_theta"], "rope_scaling": None,
           "tie_word_embeddings": False, "torch_dtype": "float32", "num_target_layers": 0,
           "layer_types": ["full_attention"] * c.num_hidden_layers,
           **config}
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({n: t.contiguous() for n, t in head.state_dict().items()}, str(root / "model.safetensors"))
    return root


def test_a_modelopt_dflash_export_is_read_as_the_dflash_head_it_holds(target, tmp_path):  # noqa: F811
    """Its target_layer_ids count decoder-layer outputs (ours are one more); num_target_layers 0 is read as not
    written (as a z-lab folder without the key); every tensor maps onto the head's state dict unchanged."""
    head = dflash_head(target, aux=(2, 4, 5))
    folder = modelopt_folder(tmp_path / "mo", head)
    assert foreign_format(folder) == "dflash"
    read = read_foreign_head(folder, INFO)
    assert (read.config["aux_layers"], read.config["block_size"], read.config["mask_token_id"]) == ([2, 4, 5], 4, MASK)
    assert read.config["num_target_layers"] is None and read.borrowed == {}
    model = load_foreign_head(folder, target)
    assert model.fc.weight.dtype == torch.float32
    assert_same_state(model.state_dict(), head)


def _dspark(folder: Path) -> None:
    """What ``DSparkExporter`` adds: the Markov head's fields in ``dflash_config`` and its tensors."""
    _edit_config(folder, dflash_config={"projector_type": "dspark", "shift_label": True, "markov_rank": 8,
                                        "markov_head_type": "vanilla", "use_confidence_head": True})
    head = {"markov_w1.weight": torch.zeros(V, 8), "markov_w2.weight": torch.zeros(V, 8),
            "confidence_proj.weight": torch.zeros(1, H + 8), "confidence_proj.bias": torch.zeros(1)}
    _edit_weights(folder, lambda w: w.update(head))


MODELOPT = {
    "dspark": (_dspark, r"dflash_config.projector_type 'dspark' \(a dspark head beside the DFlash layers"),
    "domino": (lambda f: _edit_config(f, dflash_config={"projector_type": "domino", "shift_label": True}),
               r"projector_type 'domino'"),
    "shifted slots": (lambda f: _edit_config(f, dflash_config={"shift_label": True}),
                      r"shift_label: true \(block slot k drafts the token at anchor \+ k \+ 1"),
    "causal": (lambda f: _edit_config(f, dflash_config={"causal": True}), r"dflash_config.causal: true"),
    "sliding window": (lambda f: _edit_config(f, sliding_window=16, dflash_config={"use_swa": True,
                                                                                    "swa_window_size": 16}),
                       r"dflash_config.use_swa: true"),
    "target depth": (lambda f: _edit_config(f, num_target_layers=36), r"head num_target_layers 36 != target tiny"),
}


@pytest.mark.parametrize("case", list(MODELOPT))
def test_modelopt_exports_the_dflash_head_does_not_compute_are_refused(case, target, tmp_path):  # noqa: F811
    """DSpark (and Domino) trains slot k on the token at anchor + k + 1 beside a head of its own; a causal or
    sliding-window draft attends otherwise; a written depth other than the target's is another target's."""
    edit, message = MODELOPT[case]
    folder = modelopt_folder(tmp_path / "mo", dflash_head(target, (2, 4, 5)))
    assert_refused(lambda f: read_foreign_head(f, INFO), folder, edit, message, "z-lab's DFlash format")
