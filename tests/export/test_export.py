"""Export to vLLM / SGLang Hub folders: round trip, loader-shaped check, strict keys, Medusa-2, atomicity, card."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from specheads.export import ExportError, export_head, head_tensors, target_origin
from specheads.export import export as export_mod
from specheads.models.eagle1 import Eagle1Config, Eagle1Model
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from specheads.models.medusa import medusa_for_target
from specheads.models.vocab import build_draft_vocab
from tests.conftest import make_tiny_target

V, H, LAYERS, DV = 256, 64, 4, 100
AUX = (3, 0, 2)  # deliberately unsorted: the engines concatenate aux states in ascending layer order


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)


def _randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def make_head(method: str, target, draft_vocab: int = DV, aux=AUX, layers: int = 1):
    if method == "medusa":
        return _randomize(medusa_for_target(target, num_heads=3, num_layers=2))
    if method == "eagle1":
        return _randomize(Eagle1Model(Eagle1Config.from_target(target, num_layers=layers)))
    model = _randomize(Eagle3Model(Eagle3Config.from_target(target, draft_vocab, aux_layers=aux)))
    counts = torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(1))
    model.set_draft_vocab(*build_draft_vocab(counts, draft_vocab))
    return model


def save_head(model, root: Path) -> Path:
    model.save_pretrained(root / "head")
    return root / "head"


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


# --------------------------------------------------------------------------- loader-shaped expectations
# Built from the exported config.json the way each engine's module is built, and from the engine's
# name rules, independently of specheads.export.layouts (facts: docs/export.md).


def _llama_layer(c: dict, prefix: str, in_features: int, input_norm: bool, hidden_norm: bool) -> dict:
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    h, i = c["hidden_size"], c["intermediate_size"]
    p = {f"{prefix}.self_attn.qkv_proj.weight": ((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd,
                                                 in_features),
         f"{prefix}.self_attn.o_proj.weight": (h, c["num_attention_heads"] * hd),
         f"{prefix}.mlp.gate_up_proj.weight": (2 * i, h), f"{prefix}.mlp.down_proj.weight": (h, i),
         f"{prefix}.post_attention_layernorm.weight": (h,)}
    if input_norm:
        p[f"{prefix}.input_layernorm.weight"] = (h,)
    if hidden_norm:
        p[f"{prefix}.hidden_norm.weight"] = (h,)
    return p


def engine_module_params(method: str, engine: str, c: dict, target_vocab: int) -> dict[str, tuple]:
    """Parameters the engine's drafter module has that must come from the file (shared ones left out)."""
    h = c["hidden_size"]
    if method == "medusa":
        p = {}
        for k in range(c["num_heads"]):
            for j in range(c["num_hidden_layers"]):
                p[f"blocks.{k}.layers.{j}.weight"] = (h, h)
                if c.get("medusa_fc_bias", False):
                    p[f"blocks.{k}.layers.{j}.bias"] = (h,)
            p[f"lm_heads.{k}.weight"] = (c["truncated_vocab_size"], h)
        return p
    if method == "eagle1":
        p = {"model.fc.weight": (h, 2 * h)}
        if engine == "sglang":
            p["model.fc.bias"] = (h,)
        for i in range(c["num_hidden_layers"]):
            p.update(_llama_layer(c, f"model.layers.{i}", h, input_norm=i > 0, hidden_norm=False))
        return p
    n_aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    p = {"model.fc.weight": (h, n_aux * c.get("target_hidden_size", h)), "model.norm.weight": (h,),
         "lm_head.weight": (c["draft_vocab_size"], h)}
    p.update(_llama_layer(c, "model.layers.0", 2 * h, input_norm=True, hidden_norm=True))
    if engine == "vllm" and c["draft_vocab_size"] != target_vocab:
        p["draft_id_to_target_id"] = (c["draft_vocab_size"],)
    if engine == "sglang":
        p["hot_token_id"] = (c["draft_vocab_size"],)  # built from d2t, which SGLang needs for a smaller vocabulary
    return p


_STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
            ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def engine_load(method: str, engine: str, names: dict[str, tuple]) -> dict[str, tuple]:
    """Apply the engine loader's name rules to the file's tensors; stacked shards sum their rows.

    Returns {module parameter: shape}; raises like the loader would on a key with no destination.
    """
    loaded: dict[str, tuple] = {}
    for name, shape in names.items():
        if method == "medusa":
            dest = name
        elif "t2d" in name and method == "eagle3":
            continue
        elif name == "d2t" and method == "eagle3":
            dest = "draft_id_to_target_id" if engine == "vllm" else "hot_token_id"
        elif "lm_head" in name:
            if method == "eagle1":
                raise AssertionError(f"{engine} EAGLE-1 has no own lm_head: {name} would fail or be dropped")
            dest = name
        else:
            dest = "model." + name.replace("midlayer.", "layers.0.")
        for shard, stacked in _STACKED.items():
            if shard + "." in dest:
                dest = dest.replace(shard + ".", stacked + ".")
                if dest in loaded:
                    shape = (loaded[dest][0] + shape[0], *shape[1:])
        loaded[dest] = tuple(shape)
    return loaded


def file_shapes(folder: Path) -> dict[str, tuple]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


# --------------------------------------------------------------------------- round trips

CASES = [("medusa", "vllm"), ("eagle1", "vllm"), ("eagle1", "sglang"), ("eagle3", "vllm"), ("eagle3", "sglang")]


@pytest.mark.parametrize("method,engine", CASES)
def test_export_loads_like_the_engine(method, engine, target, target_dir, tmp_path):
    head = make_head(method, target)
    out = export_head(save_head(head, tmp_path), tmp_path / "out", engine=engine, target=str(target_dir))
    config = json.loads((out / "config.json").read_text())
    loaded = engine_load(method, engine, file_shapes(out))
    assert loaded == engine_module_params(method, engine, config, V)


@pytest.mark.parametrize("method,engine", CASES)
def test_round_trip_values_and_config(method, engine, target, target_dir, tmp_path):
    head = make_head(method, target)
    out = export_head(save_head(head, tmp_path), tmp_path / "out", engine=engine, target=str(target_dir))
    got, want = tensors(out), {k: v for k, v in head.state_dict().items()}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{("medusa", "vllm"): "MedusaModel", ("eagle1", "vllm"): "EagleLlamaForCausalLM",
                                        ("eagle1", "sglang"): "LlamaForCausalLMEagle"}.get((method, engine),
                                                                                           "LlamaForCausalLMEagle3")]
    for name, t in got.items():
        if name == "fc.bias":
            assert engine == "sglang" and not t.any()  # SGLang's fc has a bias; the trained fc has none
        elif name == "fc.weight" and method == "eagle3":
            continue  # column blocks reordered: checked functionally below
        else:
            assert_close(t, want[name], rtol=0, atol=0, msg=name)
    if method == "medusa":
        assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["num_hidden_layers"] == 2
        assert config["medusa_fc_bias"] is True and config["truncated_vocab_size"] == V
        return
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(out)  # what both engines parse first
    assert hf.model_type == "llama" and hf.hidden_size == H and hf.vocab_size == V and not hf.tie_word_embeddings
    assert hf.num_hidden_layers == 1 and hf.rope_parameters["rope_theta"] == target.config.rope_parameters["rope_theta"]
    if method == "eagle3":
        _check_eagle3(head, got, hf, engine)


def _check_eagle3(head, got, hf, engine):
    ids = hf.eagle_config["eagle_aux_hidden_state_layer_ids"]
    assert ids == ([0, 2, 3] if engine == "vllm" else [-1, 1, 2])  # SGLang ids count layer outputs
    assert hf.draft_vocab_size == DV and hf.target_hidden_size == H
    # The engine concatenates the captured states in ascending layer order: same fused input as the head's.
    feats = {layer: torch.randn(2, 5, H) for layer in AUX}
    ours = head.fuse(torch.cat([feats[i] for i in AUX], -1))
    theirs = torch.cat([feats[i] for i in sorted(AUX)], -1) @ got["fc.weight"].T
    assert_close(theirs, ours)
    if engine == "vllm":
        assert "d2t" in got and got["d2t"].dtype == torch.int64
    target_ids = torch.arange(DV) + got["d2t"]
    assert torch.equal(target_ids, head.t2d.nonzero().flatten())


def test_both_engines_write_two_folders_and_medusa_only_vllm(target, target_dir, tmp_path):
    out = export_head(save_head(make_head("eagle3", target), tmp_path), tmp_path / "e3", "both", str(target_dir))
    assert sorted(p.name for p in out.iterdir()) == ["sglang", "vllm"]
    assert "fc.bias" not in tensors(out / "vllm") and "d2t" in tensors(out / "sglang")
    m = export_head(save_head(make_head("medusa", target), tmp_path / "m"), tmp_path / "med", "both", str(target_dir))
    assert sorted(p.name for p in m.iterdir()) == ["vllm"]


def test_full_size_draft_vocab_has_no_d2t_for_vllm(target, target_dir, tmp_path):
    head = make_head("eagle3", target, draft_vocab=V)
    out = export_head(save_head(head, tmp_path), tmp_path / "out", "both", str(target_dir))
    assert "d2t" not in tensors(out / "vllm")  # vLLM has no draft map then: a d2t would be a load error
    assert not tensors(out / "sglang")["d2t"].any()
    config = json.loads((out / "vllm" / "config.json").read_text())
    assert engine_load("eagle3", "vllm", file_shapes(out / "vllm")) == engine_module_params("eagle3", "vllm", config, V)


def test_sharded_head_folder(target, target_dir, tmp_path):
    head = make_head("medusa", target)
    head.save_pretrained(tmp_path / "head", max_shard_size="100KB")
    assert (tmp_path / "head" / "model.safetensors.index.json").is_file()
    out = export_head(tmp_path / "head", tmp_path / "out", "vllm", str(target_dir))
    got = tensors(out)
    assert got.keys() == head.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in head.state_dict().items())


def test_bfloat16_export_casts_floats_only(target, target_dir, tmp_path):
    out = export_head(save_head(make_head("eagle3", target), tmp_path), tmp_path / "out", "vllm", str(target_dir),
                      dtype="bfloat16")
    got = tensors(out)
    assert got["lm_head.weight"].dtype == torch.bfloat16 and got["d2t"].dtype == torch.int64
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_head_table_matches_the_head_classes(target):
    """layouts.head_tensors is what the head classes really save (catches drift in specheads/models)."""
    for method, model in [("medusa", make_head("medusa", target)), ("eagle1", make_head("eagle1", target, layers=2)),
                          ("eagle3", make_head("eagle3", target))]:
        cfg = model.config.to_dict()
        table = {k: s.shape for k, s in head_tensors(method, cfg).items()}
        assert table == {k: tuple(v.shape) for k, v in model.state_dict().items()}, method


# --------------------------------------------------------------------------- strictness


def _rewrite(head: Path, edit) -> None:
    t = tensors(head)
    edit(t)
    save_file(t, str(head / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.__setitem__("layers.0.extra.weight", torch.zeros(2)), "unknown key(s) ['layers.0.extra.weight']"),
    (lambda t: t.pop("layers.0.mlp.up_proj.weight"), "missing key(s) ['layers.0.mlp.up_proj.weight']"),
    (lambda t: t.__setitem__("fc.weight", torch.zeros(H, H)), "key 'fc.weight' has shape [64, 64], expected [64, 128]"),
    (lambda t: t.__setitem__("fc.weight", t["fc.weight"].half()), "float tensors mix dtypes"),
])
def test_bad_head_keys_fail_naming_the_key(edit, message, target, target_dir, tmp_path):
    head = save_head(make_head("eagle1", target), tmp_path)
    _rewrite(head, edit)
    with pytest.raises(ExportError) as e:
        export_head(head, tmp_path / "out", "vllm", str(target_dir))
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_eagle3_errors(target, target_dir, tmp_path):
    unset = _randomize(Eagle3Model(Eagle3Config.from_target(target, DV, aux_layers=AUX)))  # d2t/t2d never set
    with pytest.raises(ExportError, match="d2t and t2d disagree"):
        export_head(save_head(unset, tmp_path / "a"), tmp_path / "out", "vllm", str(target_dir))
    repeated = make_head("eagle3", target, aux=(2, 2, 1))
    with pytest.raises(ExportError, match="repeat a layer"):
        export_head(save_head(repeated, tmp_path / "b"), tmp_path / "out", "vllm", str(target_dir))
    beyond = make_head("eagle3", target, aux=(0, 2, 7))
    with pytest.raises(ExportError, match=r"aux layers \[7\] do not exist"):
        export_head(save_head(beyond, tmp_path / "c"), tmp_path / "out", "vllm", str(target_dir))


def test_unsupported_requests_fail_clearly(target, target_dir, tmp_path):
    medusa = save_head(make_head("medusa", target), tmp_path)
    with pytest.raises(ExportError, match="sglang has no loader for medusa"):
        export_head(medusa, tmp_path / "out", "sglang", str(target_dir))
    with pytest.raises(ExportError, match="engine=tgi: use one of"):
        export_head(medusa, tmp_path / "out", "tgi", str(target_dir))
    with pytest.raises(ExportError, match="repo id"):
        export_head(medusa, tmp_path / "out", "vllm", str(target_dir), push_to_hub="not a repo")
    other = make_tiny_target("llama", vocab=V, hidden=32, layers=LAYERS)
    other.model.save_pretrained(tmp_path / "other")
    with pytest.raises(ExportError, match="hidden_size 64 != target"):
        export_head(medusa, tmp_path / "out", "vllm", str(tmp_path / "other"))
    with pytest.raises(ExportError, match="model_type 'llama'; a specheads head folder has one of"):
        export_head(tmp_path / "other", tmp_path / "out", "vllm", str(target_dir))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="not a saved head folder"):
        export_head(tmp_path / "empty", tmp_path / "out", "vllm", str(target_dir))
    assert not (tmp_path / "out").exists()


def test_target_identity(target, target_dir, tmp_path, caplog):
    medusa = save_head(make_head("medusa", target), tmp_path)
    other = make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)
    other.model.config.rms_norm_eps = 1e-3  # same sizes, a different model
    other.model.save_pretrained(tmp_path / "other")
    with caplog.at_level("WARNING"):
        export_head(medusa, tmp_path / "a", "vllm", str(tmp_path / "other"))
    assert "record target config hash" in caplog.text
    out = export_head(medusa, tmp_path / "b", "vllm", target=None)  # sizes from the head, name as recorded
    assert "# Medusa draft head for tiny-llama (vllm)" in (out / "README.md").read_text()


# --------------------------------------------------------------------------- atomicity


def test_failed_export_leaves_no_half_written_folder(target, target_dir, tmp_path, monkeypatch):
    head = save_head(make_head("eagle3", target), tmp_path)
    out = tmp_path / "exports" / "e3"
    export_head(head, out, "both", str(target_dir))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def fail_after_weights(sub, *args):
        assert (sub / "model.safetensors").is_file()  # the failure strikes mid-export
        raise OSError("disk full")

    monkeypatch.setattr(export_mod, "write_card", fail_after_weights)
    with pytest.raises(OSError, match="disk full"):
        export_head(head, out, "both", str(target_dir), dtype="bfloat16", overwrite=True)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # the old export is intact
    with pytest.raises(OSError):
        export_head(head, tmp_path / "exports" / "fresh", "vllm", str(target_dir))
    assert sorted(os.listdir(out.parent)) == ["e3"]  # no temporary or partial folder left
    with pytest.raises(ExportError, match="already exists"):
        export_head(head, out, "both", str(target_dir))
    with pytest.raises(ExportError, match="would replace the head folder"):
        export_head(head, tmp_path, "both", str(target_dir), overwrite=True)
    assert (head / "model.safetensors").is_file()


# --------------------------------------------------------------------------- Medusa-2 and the model card


def test_medusa2_export_carries_the_adapted_target(target_dir, tmp_path):
    from specheads.methods.medusa import Medusa2Method

    tgt = make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)  # fresh: LoRA is injected in place
    method = Medusa2Method(num_heads=2, lora_r=4)
    model = method.build(tgt)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)  # a real adaptation, so the merged target differs from the original
    method.save(model, str(tmp_path / "head"), tgt)
    out = export_head(tmp_path / "head", tmp_path / "out", "vllm", str(target_dir))
    adapted = tensors(tmp_path / "head" / "target")
    assert tensors(out / "target").keys() == adapted.keys()
    for k, v in tensors(out / "target").items():
        assert torch.equal(v, adapted[k]), k
    original = tensors(target_dir)
    assert any(not torch.equal(adapted[k], original[k]) for k in original if k in adapted)
    card = (out / "README.md").read_text()
    assert "vllm serve <path-or-repo-id-of-this-folder>/target --speculative-config" in card
    assert '"method": "medusa"' in card and str(tmp_path) not in card
    assert json.loads((out / "config.json").read_text())["num_heads"] == 2
    both = export_head(tmp_path / "head", tmp_path / "out2", "all", str(target_dir))
    tgi = json.loads((both / "medusa" / "config.json").read_text())
    assert tgi["base_model_name_or_path"] == str(both / "medusa" / "target")  # TGI serves the adapted target
    assert (both / "medusa" / "target" / "config.json").is_file()


def _report(path: Path) -> Path:
    """An evaluate report.json: the head's tree, its two serving profiles and a baseline."""
    def row(alpha, tau):
        return {"alpha": alpha, "tau": tau, "alpha_by_position": [0.8, 0.6, 0.4], "tokens_per_s": 10.0}

    def method(name, drafter, profile, shape, alpha, mismatches=()):
        return {"name": name, "drafter": drafter, "profile": profile, "shape": shape,
                "lossless": {"checked": 4, "mismatches": list(mismatches), "exact": not mismatches},
                "by_temperature": {"0.0": {"all": row(alpha, 2.45), "code": row(0.5, 2.0)}}}

    report = {"target": "tiny", "methods": [
        method("eagle3-tree", "eagle3", None, "tree(d5,k4,n24)", 0.71),
        method("eagle3-sglang", "eagle3", "sglang", "tree(d4,k2,n9)", 0.66,
               [{"prompt": "mt-1", "index": 5, "margin": 0.0}]),
        method("eagle3-vllm", "eagle3", "vllm", "chain2", 0.61),
        method("ngram-chain4", "ngram", None, "chain4", 0.11)]}
    path.write_text(json.dumps(report))
    return path


def test_model_card_states_the_facts_and_commands(target, target_dir, tmp_path):
    head = save_head(make_head("eagle3", target), tmp_path)
    (tmp_path / "train_summary.json").write_text(json.dumps({"steps": 7, "train_tokens": 1234, "tau_estimate": 2.1}))
    out = export_head(tmp_path, tmp_path / "out", "both", str(target_dir), eval_report=_report(tmp_path / "r.json"),
                      data="ShareGPT, 600 chats")  # the training output folder (holding head/) also works
    vllm, sgl = (out / "vllm" / "README.md").read_text(), (out / "sglang" / "README.md").read_text()
    assert "ShareGPT, 600 chats" in vllm and f"{DV} of {V} target tokens" in vllm and "7 steps" in vllm
    assert "inputs of target decoder layers [3, 0, 2]" in vllm and "vllm ids [0, 2, 3]" in vllm
    assert "| eagle3-vllm ◀ | chain2 | 0.0 | all | 0.610 | 2.450 | 0.800, 0.600, 0.400 |" in vllm
    assert "| eagle3-sglang ◀ | tree(d4,k2,n9) |" in sgl and "ngram" not in vllm  # baselines are not this head
    folder = "<path-or-repo-id-of-this-folder>"  # the card never names a path of the exporting machine
    spec = {"method": "eagle3", "model": folder, "num_speculative_tokens": 2}  # the measured profile
    # A local target folder has no hub id: a placeholder, set by a line to edit, and a warning; never the local path.
    assert f"vllm serve $TARGET --speculative-config '{json.dumps(spec)}'" in vllm
    assert "TARGET=/path/to/the/target/model   # REPLACE" in vllm and "> **Warning**: The head was trained" in vllm
    assert (f"python -m sglang.launch_server --model-path $TARGET --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {folder} --speculative-num-steps 4 --speculative-eagle-topk 2 "
            "--speculative-num-draft-tokens 10") in sgl
    assert f"serve {target_dir.resolve()}" not in vllm + sgl and "base_model" not in vllm
    assert "sglang ids [-1, 1, 2]" in sgl
    # The lossless check of the report, per measured method of this head.
    assert "- eagle3-vllm: exact on all 4 prompts" in vllm and "- eagle3-sglang: **1 mismatches** in 4 prompts" in vllm
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    meta = {"target": "tiny", "num_samples": 976, "num_tokens": 1331771, "num_loss_tokens": 996587, "max_length": 2048,
            "regenerated": False, "source": {"source": "sharegpt", "path": None, "split": "train"}}
    (prepared / "specheads_meta.json").write_text(json.dumps(meta))
    (tmp_path / "train_summary.json").write_text(json.dumps({"steps": 7, "prepared_dir": str(prepared)}))
    card = (export_head(head, tmp_path / "out3", "vllm", str(target_dir)) / "README.md").read_text()
    assert "| data | sharegpt (train split): 976 conversations, 1331771 tokens (996587 assistant)" in card
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"methods": [{"name": "x"}]}))
    with pytest.raises(ExportError, match="not an evaluate report.json"):
        export_head(head, tmp_path / "out2", "vllm", str(target_dir), eval_report=bad)
    medusa_report = tmp_path / "m.json"
    medusa_report.write_text(json.dumps({"methods": [{"name": "medusa-tree", "drafter": "medusa", "by_temperature": {}}]}))
    with pytest.raises(ExportError, match="measured no eagle3 head"):
        export_head(head, tmp_path / "out2", "vllm", str(target_dir), eval_report=medusa_report)


def test_export_recipe_composes_and_runs(target, target_dir, tmp_path):
    from hydra import compose, initialize_config_dir

    head = save_head(make_head("eagle1", target), tmp_path)
    conf = Path(__file__).resolve().parents[2] / "conf"
    import runpy

    recipe = runpy.run_path(str(conf.parent / "recipes" / "export.py"))
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("export", overrides=[f"head_dir={head}", f"out_dir={tmp_path / 'out'}", "engine=sglang",
                                           "target=hf", f"target.name_or_path={target_dir}"])
        assert cfg.push_to_hub is None and cfg.target.name_or_path == str(target_dir)
        path = recipe["run"](cfg)
        with pytest.raises(Exception, match="enginee"):
            compose("export", overrides=["enginee=vllm"])
        with pytest.raises(Exception, match="spec_tokens"):
            compose("export", overrides=["spec_tokens=three"])
    assert "fc.bias" in tensors(Path(path))


@pytest.mark.slow
def test_smollm2_eagle3_export_through_the_cli(smollm2, tmp_path):
    """The real target: default aux layers (2, 15, 27) -> vLLM ids as is, SGLang ids minus one; CLI end to end."""
    import subprocess
    import sys

    head = Eagle3Model(Eagle3Config.from_target(smollm2, draft_vocab_size=2000))
    counts = torch.arange(smollm2.vocab_size).flip(0)
    head.set_draft_vocab(*build_draft_vocab(counts, 2000))
    head = save_head(head, tmp_path)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, "-m", "specheads.cli", "export", f"head_dir={head}",
                           f"out_dir={tmp_path / 'out'}", "dtype=bfloat16"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for engine, ids in (("vllm", [2, 15, 27]), ("sglang", [1, 14, 26])):
        config = json.loads((tmp_path / "out" / engine / "config.json").read_text())
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
        assert config["vocab_size"] == 49152 and config["draft_vocab_size"] == 2000 and config["hidden_size"] == 576
        loaded = engine_load("eagle3", engine, file_shapes(tmp_path / "out" / engine))
        assert loaded == engine_module_params("eagle3", engine, config, 49152)
        card = (tmp_path / "out" / engine / "README.md").read_text()
        # The embedded target is a dequantized GGUF in a local cache: a placeholder and a warning, never that path.
        assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "> **Warning**" in card
        assert "TARGET=HuggingFaceTB/SmolLM2-135M-Instruct   # REPLACE" in card and "/.cache/" not in card
    spec = json.loads((tmp_path / "out" / "speculators" / "config.json").read_text())
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert file_shapes(tmp_path / "out" / "speculators")["embed_tokens.weight"] == (49152, 576)
    (tmp_path / "empty").mkdir()
    bad = subprocess.run([sys.executable, "-m", "specheads.cli", "export", f"head_dir={tmp_path / 'empty'}",
                          f"out_dir={tmp_path / 'out2'}"], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "specheads export: error:" in bad.stderr and "not a saved head folder" in bad.stderr


def test_medusa_export_carries_the_training_time_tree(target, target_dir, tmp_path, caplog):
    """The static tree calibrated at training time (``medusa_tree.json``) travels with the heads."""
    from specheads.methods.medusa import TREE_FILE, read_medusa_tree, write_medusa_tree

    head = save_head(make_head("medusa", target), tmp_path)
    plain = export_head(head, tmp_path / "plain", "vllm", str(target_dir))
    assert not (plain / TREE_FILE).exists() and "has no medusa_tree.json" in caplog.text
    saved = write_medusa_tree(head, [[0.6, 0.2], [0.4, 0.1], [0.3, 0.05]], num_nodes=5)
    out = export_head(head, tmp_path / "out", "both", str(target_dir))
    assert read_medusa_tree(out / "vllm") == saved and len(saved["medusa_choices"]) == 5
    (head / TREE_FILE).write_text('{"format": "something else"}')
    with pytest.raises(ExportError, match="not a specheads.medusa_tree/1 file"):
        export_head(head, tmp_path / "bad", "vllm", str(target_dir))


# --------------------------------------------------------------------------- issue 14: card target, permissions


def test_card_names_the_target_by_its_hub_id(target, target_dir, tmp_path):
    """Issue 14 fault 4: the card's commands and base_model name the id a user serves, never a local path."""
    head = save_head(make_head("eagle3", target), tmp_path)
    report = _report(tmp_path / "r.json")
    out = export_head(head, tmp_path / "out", "vllm", str(target_dir), eval_report=report, target_id="org/tiny-llama")
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: org/tiny-llama\n") and "> **Warning**" not in card
    spec = {"method": "eagle3", "model": "<path-or-repo-id-of-this-folder>", "num_speculative_tokens": 2}
    assert f"vllm serve org/tiny-llama --speculative-config '{json.dumps(spec)}'" in card
    assert "LLM(model='org/tiny-llama'" in card and str(target_dir) not in card.split("## Serve it")[1]
    assert "| eagle3-vllm ◀ | chain2 | 0.0 | all | 0.610 | 2.450 |" in card and "exact on all 4 prompts" in card
    # A hub cache folder names its repo; the hub id given as the target is used as is.
    cache = tmp_path / "hub" / "models--acme--tiny-chat" / "snapshots" / "0123abc"
    cache.parent.mkdir(parents=True)
    import shutil
    shutil.copytree(target_dir, cache)
    card = (export_head(head, tmp_path / "out2", "sglang", str(cache)) / "README.md").read_text()
    assert "base_model: acme/tiny-chat" in card and "--model-path acme/tiny-chat " in card
    assert target_origin("acme/other", None).hub_id == "acme/other"
    with pytest.raises(ExportError, match="target_id must be a hub id"):
        export_head(head, tmp_path / "out3", "vllm", str(target_dir), target_id="/a/local/path")


def test_card_of_the_embedded_gguf_target_warns_and_suggests_the_original(tmp_path):
    origin = target_origin("smollm2", "/cache/models/SmolLM2-135M-Instruct")
    assert origin.hub_id is None and origin.hint == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "GGUF" in origin.warning() and "HuggingFaceTB/SmolLM2-135M-Instruct" in origin.warning()
    gguf = target_origin("/models/llama.Q4_K_M.gguf", "/cache/models/llama")
    assert gguf.hub_id is None and "GGUF file" in gguf.warning()


def test_eval_report_auto_finds_the_pipeline_report(target, target_dir, tmp_path):
    """The pipeline layout: <run>/train/<head>/head and <run>/eval/<head>/report.json."""
    head = save_head(make_head("eagle3", target), tmp_path / "run" / "train" / "eagle3")
    (tmp_path / "run" / "eval" / "eagle3").mkdir(parents=True)
    _report(tmp_path / "run" / "eval" / "eagle3" / "report.json")
    out = export_head(head, tmp_path / "out", "vllm", str(target_dir), eval_report="auto")
    card = (out / "README.md").read_text()
    assert "| eagle3-vllm ◀ | chain2 |" in card and "(`eval/eagle3/report.json`)" in card and str(tmp_path) not in card
    alone = save_head(make_head("eagle3", target), tmp_path / "alone")
    out2 = export_head(alone, tmp_path / "out2", "vllm", str(target_dir), eval_report="auto")
    card = (out2 / "README.md").read_text()
    assert "Not measured" in card


def test_exported_files_are_world_readable(target_dir, tmp_path):
    """Issue 14 fault 5: safetensors' atomic write leaves model.safetensors 0600; a server running as another
    user must read every exported file (0644) and folder (0755), the Medusa-2 adapted target included."""
    from specheads.methods.medusa import Medusa2Method

    tgt = make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)
    method = Medusa2Method(num_heads=2, lora_r=4)
    model = method.build(tgt)
    method.save(model, str(tmp_path / "head"), tgt)
    for f in (tmp_path / "head").rglob("*"):
        if f.is_file():
            os.chmod(f, 0o600)  # as an atomic (tempfile) write leaves them
    out = export_head(tmp_path / "head", tmp_path / "out", "vllm", str(target_dir))
    modes = {p.relative_to(out): p.stat().st_mode & 0o777 for p in out.rglob("*")}
    assert (out.stat().st_mode & 0o777) == 0o755
    assert any(p.name == "model.safetensors" for p in modes)
    assert any(p.parts[0] == "target" and len(p.parts) > 1 for p in modes)  # the copied adapted target
    bad = {str(p): oct(m) for p, m in modes.items() if m != ((0o755 if (out / p).is_dir() else 0o644))}
    assert not bad


# --------------------------------------------------------------------------- round trip through our loader

ALL_CASES = CASES + [("eagle3", "speculators"), ("medusa", "medusa")]


@pytest.mark.parametrize("method,engine", ALL_CASES)
def test_round_trip_logits_through_our_loader(method, engine, target, target_dir, tmp_path):
    """Each exported folder, loaded back with specheads' loader, gives the head's logits before export."""
    from specheads.export import load_exported

    head = make_head(method, target, layers=2 if method == "eagle1" else 1).eval()
    out = export_head(save_head(head, tmp_path), tmp_path / "out", engine, str(target_dir))
    back = load_exported(out)
    assert type(back) is type(head)
    g = torch.Generator().manual_seed(3)
    T = 6
    ids, pos = torch.randint(0, V, (2, T), generator=g), torch.arange(T).expand(2, T)
    with torch.no_grad():
        if method == "medusa":
            x = torch.randn(2, T, H, generator=g)
            assert torch.equal(back(x), head(x))
            return
        head.attach(target), back.attach(target)
        n_aux = len(AUX) if method == "eagle3" else 1
        feats = torch.randn(2, T, n_aux * H, generator=g)
        h_a, logits_a = head.step(head.fuse(feats), ids, pos)
        h_b, logits_b = back.step(back.fuse(feats), ids, pos)
    assert torch.equal(logits_a, logits_b) and torch.equal(h_a, h_b)
    if method == "eagle3":
        assert torch.equal(back.to_target_ids(logits_b.argmax(-1)), head.to_target_ids(logits_a.argmax(-1)))


@pytest.mark.parametrize("method,engine", [("eagle3", "speculators"), ("eagle3", "vllm"), ("eagle1", "sglang"),
                                           ("medusa", "medusa")])
def test_round_trip_same_acceptance_on_prompts(method, engine, target, target_dir, tmp_path):
    """The reloaded head drafts the same tokens: same output, α and τ counts on a few prompts (T = 0)."""
    from specheads.decoding.drafters import TreeShape
    from specheads.decoding.generate import speculative_generate
    from specheads.decoding.runner import TargetRunner
    from specheads.export import load_exported
    from specheads.methods import build_method

    head = make_head(method, target).eval()
    with torch.no_grad():  # plant drafts that repeat the target's own next token, so some are accepted
        if method == "medusa":
            for k in range(head.config.num_heads):
                head.lm_heads[k].weight.copy_(target.lm_head.weight)
                for block in head.blocks[k].layers:
                    block.weight.zero_(), block.bias.zero_()
        if method == "eagle1":
            head.fc.weight.zero_()
            head.fc.weight[:, H:].copy_(torch.eye(H))
            for name, p in head.layers.named_parameters():
                if "o_proj" in name or "down_proj" in name:
                    p.zero_()
    back = load_exported(export_head(save_head(head, tmp_path), tmp_path / "out", engine, str(target_dir)))
    cls = build_method("medusa1" if method == "medusa" else method)
    prompts = [[1, 5, 9, 13, 17, 21], [2, 4, 8, 16, 32]]
    runs = []
    for model in (head, back):
        if method != "medusa":
            model.attach(target)
        drafter = cls.drafter(model, TreeShape("chain", k=3))
        res = speculative_generate(TargetRunner(target.model), drafter, prompts, 12)
        runs.append((res.tokens, [(s.steps, s.emitted, s.tested, s.accepted) for s in res.stats]))
    assert runs[0] == runs[1]
    if method in ("medusa", "eagle1"):
        assert sum(sum(s[3]) for s in runs[0][1]) > 0  # the planted drafts are accepted: α > 0 compared


# --------------------------------------------------------------------------- Hub publishing (a local stand-in)


class StandInHub:
    """A local stand-in with the two HfApi methods the export calls (no Hub is reachable here):
    files land in ``root/<repo id>/<path_in_repo>/``."""

    def __init__(self, root: Path):
        self.root, self.repos, self.calls = root, {}, []

    @staticmethod
    def _check(name, *args, **kwargs):  # the call must fit huggingface_hub's real signature
        from huggingface_hub import HfApi
        import inspect

        inspect.signature(getattr(HfApi, name)).bind(None, *args, **kwargs)

    def create_repo(self, repo_id, repo_type="model", private=None, exist_ok=False):
        self._check("create_repo", repo_id, repo_type=repo_type, private=private, exist_ok=exist_ok)
        self.calls.append(("create_repo", repo_id, private))
        self.repos.setdefault(repo_id, {"private": private})

    def upload_folder(self, repo_id, folder_path, path_in_repo=None, repo_type="model", commit_message=None):
        import shutil

        self._check("upload_folder", repo_id=repo_id, folder_path=folder_path, path_in_repo=path_in_repo,
                    repo_type=repo_type, commit_message=commit_message)
        assert repo_id in self.repos, "upload before create_repo"
        self.calls.append(("upload_folder", repo_id, path_in_repo))
        shutil.copytree(folder_path, self.root / repo_id / (path_in_repo or ""), dirs_exist_ok=True)


def test_push_to_hub_layouts_privacy_and_dry_run(target, target_dir, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
    head = save_head(make_head("eagle3", target), tmp_path)
    hub = StandInHub(tmp_path / "hub")
    # Several layouts in one repo: one subfolder each; private by default.
    out = export_head(head, tmp_path / "out", "all", str(target_dir), push_to_hub="acme/e3", hub_api=hub,
                      target_id="acme/tiny")
    assert hub.repos == {"acme/e3": {"private": True}}
    assert sorted(p.name for p in (tmp_path / "hub" / "acme" / "e3").iterdir()) == ["sglang", "speculators", "vllm"]
    card = (out / "vllm" / "README.md").read_text()
    assert "huggingface-cli download acme/e3 --include 'vllm/*' --local-dir ./e3" in card
    assert '"model": "./e3/vllm"' in card
    # One repo per layout: each is servable by its id.
    hub2 = StandInHub(tmp_path / "hub2")
    out = export_head(head, tmp_path / "out2", "vllm,sglang", str(target_dir), push_to_hub="acme/e3-{engine}",
                      hub_api=hub2, hub_private=False, target_id="acme/tiny")
    assert hub2.repos == {"acme/e3-vllm": {"private": False}, "acme/e3-sglang": {"private": False}}
    assert (tmp_path / "hub2" / "acme" / "e3-vllm" / "model.safetensors").is_file()
    assert '"model": "acme/e3-vllm"' in (out / "vllm" / "README.md").read_text()
    # A dry run prints the uploads and calls nothing.
    hub3 = StandInHub(tmp_path / "hub3")
    export_head(head, tmp_path / "out3", "speculators", str(target_dir), push_to_hub="acme/e3s", hub_api=hub3,
                push_dry_run=True, target_id="acme/tiny")
    printed = capsys.readouterr().out
    assert hub3.calls == [] and "would upload" in printed and "acme/e3s, private" in printed
    assert "  model.safetensors" in printed and "  README.md" in printed
    assert "hf_secret_token_value" not in printed + caplog.text
    with pytest.raises(ExportError, match="repo id"):
        export_head(head, tmp_path / "out4", "vllm", str(target_dir), push_to_hub="acme/{name}")


@pytest.mark.parametrize("engine", ["vllm", "sglang", "speculators"])
def test_fc_norm_heads_export_their_norms_in_the_engines_layer_order(engine, target, target_dir, tmp_path):
    """EAGLE-3.1's per-feature norms (vLLM 0.34 and SGLang 0.5.23 read ``fc_norm`` and ``fc_norm.{i}``): the
    engine normalises each captured state, in ascending layer order, then applies fc: the head's own fusion."""
    from specheads.export.reload import load_exported

    head = Eagle3Model(Eagle3Config.from_target(target, DV, aux_layers=AUX, fc_norm=True))
    _randomize(head)
    counts = torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(1))
    head.set_draft_vocab(*build_draft_vocab(counts, DV))
    out = export_head(save_head(head, tmp_path), tmp_path / "out", engine=engine, target=str(target_dir))
    config, got = json.loads((out / "config.json").read_text()), tensors(out)
    assert config["fc_norm"] is True and sorted(k for k in got if k.startswith("fc_norm")) == \
        [f"fc_norm.{i}.weight" for i in range(3)]
    feats = {layer: torch.randn(2, 5, H) for layer in AUX}
    eps = head.config.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    theirs = torch.cat([rms(feats[layer], got[f"fc_norm.{k}.weight"]) for k, layer in enumerate(sorted(AUX))], -1)
    assert_close(theirs @ got["fc.weight"].T, head.fuse(torch.cat([feats[i] for i in AUX], -1)))
    back = load_exported(out)
    assert back.config.fc_norm and all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())


NORMS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}  # speculators' options


def _norm_head(target, **norms) -> Eagle3Model:
    head = _randomize(Eagle3Model(Eagle3Config.from_target(target, DV, aux_layers=AUX, **norms)))
    counts = torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(1))
    head.set_draft_vocab(*build_draft_vocab(counts, DV))
    return head


@pytest.mark.parametrize("engine,norms", [("vllm", NORMS), ("speculators", NORMS),
                                          ("sglang", {"norm_before_fc": True, "norm_output": True})])
def test_normalisation_options_export_as_each_engine_reads_them(engine, norms, target, target_dir, tmp_path):
    """vLLM 0.32 and speculators 0.9 compute all three, SGLang 0.5.23 norm_before_fc and norm_output: the flags
    at the top level (explicit false for the others: vLLM's speculators conversion defaults norm_before_residual to
    true), ``input_norm`` over the fused features in ascending layer order, and a round trip that reads back equal."""
    from specheads.export.reload import load_exported

    head = _norm_head(target, **norms)
    out = export_head(save_head(head, tmp_path), tmp_path / "out", engine=engine, target=str(target_dir))
    config, got = json.loads((out / "config.json").read_text()), tensors(out)
    assert {k: config[k] for k in NORMS} == {k: k in norms for k in NORMS}
    feats = {layer: torch.randn(2, 5, H) * 3 for layer in AUX}
    eps = head.config.rms_norm_eps
    x = torch.cat([feats[layer] for layer in sorted(AUX)], -1)  # the engines concatenate ascending layers
    theirs = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * got["input_norm.weight"]
    assert_close(theirs @ got["fc.weight"].T, head.fuse(torch.cat([feats[i] for i in AUX], -1)))
    back = load_exported(out)
    assert all(getattr(back.config, k) == (k in norms) for k in NORMS)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())


def test_engines_that_do_not_compute_an_option_are_refused_by_name(target, target_dir, tmp_path):
    from specheads.export.layouts import LayoutError

    head = save_head(_norm_head(target, norm_before_residual=True), tmp_path / "a")
    with pytest.raises((LayoutError, ExportError), match=r"norm_before_residual: SGLang 0.5.23's "
                                                         r"LlamaForCausalLMEagle3 does not compute it.*engine=vllm"):
        export_head(head, tmp_path / "out", engine="sglang", target=str(target_dir))
    both = _randomize(Eagle3Model(Eagle3Config.from_target(target, DV, aux_layers=AUX, fc_norm=True,
                                                           norm_before_fc=True)))
    both.set_draft_vocab(*build_draft_vocab(torch.randint(0, 1000, (V,)), DV))
    with pytest.raises((LayoutError, ExportError), match=r"norm_before_fc with fc_norm: speculators 0.9"):
        export_head(save_head(both, tmp_path / "b"), tmp_path / "out2", engine="speculators", target=str(target_dir))


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
def test_sliding_window_and_qwen3_layers_export_as_the_engines_read_them(engine, target, target_dir, tmp_path):
    """vLLM 0.32 (qwen3_eagle3.Eagle3Qwen3ForCausalLM: q/k norms, the window of each sliding_attention layer) and
    speculators 0.9 (the layer config's model_type qwen3, sliding_window, layer_types): the fields written, the norms'
    tensors, and a round trip that reads back equal."""
    from specheads.export.reload import load_exported

    head = _norm_head(target, sliding_window=3, qk_norm=True)
    with torch.no_grad():
        head.midlayer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
    out = export_head(save_head(head, tmp_path), tmp_path / "out", engine=engine, target=str(target_dir))
    config, got = json.loads((out / "config.json").read_text()), tensors(out)
    layer = config if engine == "vllm" else config["transformer_layer_config"]
    assert {k: layer[k] for k in ("model_type", "sliding_window", "layer_types", "use_sliding_window")} == {
        "model_type": "qwen3", "sliding_window": 3, "layer_types": ["sliding_attention"], "use_sliding_window": True}
    if engine == "vllm":
        assert config["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    prefix = "midlayer" if engine == "vllm" else "layers.0"
    assert torch.equal(got[f"{prefix}.self_attn.q_norm.weight"], head.midlayer.self_attn.q_norm.weight)
    back = load_exported(out)
    assert back.config.sliding_window == 3 and back.config.layer_types == ["sliding_attention"] and back.config.qk_norm
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())


@pytest.mark.parametrize("option,word", [({"sliding_window": 3}, "a sliding-window draft layer"),
                                         ({"qk_norm": True}, "Qwen3 q/k norms")])
def test_sglang_refuses_the_draft_layer_options(option, word, target, target_dir, tmp_path):
    from specheads.export.layouts import LayoutError

    head = save_head(_norm_head(target, **option), tmp_path / "a")
    with pytest.raises((LayoutError, ExportError), match=rf"{word}.*SGLang 0.5.23's LlamaForCausalLMEagle3 does not "
                                                         r"read it .*engine=vllm or engine=speculators"):
        export_head(head, tmp_path / "out", engine="sglang", target=str(target_dir))
