"""Domino export: z-lab's DFlash folder as ModelOpt's Domino exporter writes it (``architectures:
[DFlashDraftModel]``, ``model_type: qwen3``, ``block_size``, ``dflash_config`` with ``projector_type: domino``,
``shift_label``, ``pure_draft_prefix_len``, ``gru_hidden_dim``, ``emb_dim`` and ``emb_dim`` at the top level;
``prefix_gru.*`` and ``embed_proj.*`` beside DFlash's tensors), SGLang's DFLASH serve line, no vLLM folder and a
card that says vLLM has none, and a round trip to an equal model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specheads.export import export_head, head_tensors, load_exported
from specheads.export.serve import serve_commands, serve_params
from specheads.methods.domino import DominoMethod
from tests.conftest import make_tiny_target

V, H, LAYERS, B = 256, 64, 4, 5
AUX = (3, 1, 2)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    target = make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)
    root = tmp_path_factory.mktemp("domino")
    target_dir = root / "tiny-llama"
    target.model.save_pretrained(target_dir)
    method = DominoMethod(block_size=B, aux_layers=AUX, num_layers=2, gru_hidden_dim=32, emb_dim=16)
    model = method.build(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    method.save(model, str(root / "head"), target)
    out = root / "export"
    export_head(root / "head", out, engine="all", target=str(target_dir))
    return model, out


def test_the_sglang_folder_is_modelopts_domino_format(exported):
    model, out = exported
    assert not (out / "vllm").exists() and (out / "sglang").is_dir()
    cfg = json.loads((out / "sglang" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3" and cfg["block_size"] == B
    assert cfg["emb_dim"] == 16
    d = cfg["dflash_config"]
    assert d["projector_type"] == "domino" and d["shift_label"] is True and d["pure_draft_prefix_len"] == 1
    assert (d["gru_hidden_dim"], d["emb_dim"]) == (32, 16) and d["target_layer_ids"] == [0, 1, 2]
    assert d["mask_token_id"] == model.config.mask_token_id
    with safe_open(str(out / "sglang" / "model.safetensors"), "pt") as f:
        names = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert names["prefix_gru.weight_ih_l0"] == (96, H) and names["prefix_gru.weight_hh_l0"] == (96, 32)
    assert names["embed_proj.0.weight"] == (16, H + 32) and names["embed_proj.2.weight"] == (V, 16)
    assert names["fc.weight"] == (H, 3 * H) and not any(k.startswith(("embed_tokens", "lm_head")) for k in names)


def test_head_table_matches_the_model(exported):
    model, _ = exported
    table = {k: s.shape for k, s in head_tensors("domino", model.config.to_dict()).items()}
    assert table == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_the_card_and_serve_line(exported):
    model, out = exported
    p = serve_params("domino", model.config.to_dict(), "sglang", None)
    assert p.tokens == B - 1 and p.draft_tokens == B
    cmds = serve_commands("domino", "sglang", "meta/target", str(out / "sglang"), p)
    assert "--speculative-algorithm DFLASH" in cmds["shell"] and f"--speculative-num-draft-tokens {B}" in cmds["shell"]
    card = (out / "sglang" / "README.md").read_text()
    assert "Domino" in card and "vLLM has no Domino drafter" in card and "prefix GRU" in card


def test_round_trip(exported):
    model, out = exported
    back = load_exported(out / "sglang")
    assert type(back).__name__ == "DominoModel" and back.config.shift_label is True
    want = model.state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k].to(v.dtype), v, msg=k)


def test_the_folder_reads_back_as_another_toolkits_domino_head(exported, tmp_path):
    """The folder is ModelOpt's Domino export: read as a foreign z-lab DFlash folder whose projector_type makes it a
    Domino head, it is the same head; without shift_label (the trainers' defaults differ) it is refused."""
    import shutil

    from specheads.export.foreign import ForeignHeadError, check_format, load_foreign_head
    from specheads.heads import dflash_block_size

    model, out = exported
    folder = tmp_path / "modelopt"
    shutil.copytree(out / "sglang", folder)
    (folder / "specheads_export.json").unlink()
    (folder / "README.md").unlink()
    assert check_format(folder) == ("dflash", "domino") and dflash_block_size(folder, "domino") == B
    target = make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)
    back = load_foreign_head(folder, target)
    assert type(back).__name__ == "DominoModel" and back.config.aux_layers == sorted(AUX)
    want = model.state_dict()
    blocks = want["fc.weight"].chunk(len(AUX), dim=1)  # written in ascending layer order
    want["fc.weight"] = torch.cat([blocks[j] for j in sorted(range(len(AUX)), key=lambda j: AUX[j])], dim=1)
    got = back.state_dict()
    assert set(got) == set(want)
    for k, v in got.items():
        torch.testing.assert_close(v.to(want[k].dtype), want[k], msg=k)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["dflash_config"]["shift_label"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ForeignHeadError, match="shift_label"):
        load_foreign_head(folder, target)
