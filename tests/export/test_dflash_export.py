"""DFlash export: the z-lab folder (vLLM 0.34 and SGLang 0.5.23) and speculators' folder (vLLM 0.34), checked
against the engines' loader facts (tests/export/engine_facts.py, read from the wheels) and round-tripped.

``check_format_a`` / ``check_speculators`` are the checks; ``test_planted_bugs_are_caught`` plants each bug the
checks exist for (our aux ids written as z-lab target_layer_ids, no ``sliding_window_non_causal``, a misspelt weight
name) into the layout code and requires the checks to fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from specheads.export import ExportError, export_head, head_tensors, load_exported
from specheads.export import layouts
from specheads.methods import build_method
from tests.conftest import make_tiny_target
from tests.export import engine_facts as facts

V, H, LAYERS, B = 256, 64, 4, 4
AUX = (3, 1, 2)  # unsorted and not the default (2, N//2, N-3) = {1, 2}: a fallback to a default is caught
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)


def make_dflash(target, root: Path, aux=AUX, num_layers: int = 1):
    """A tiny DFlash head (the method's own build and save), weights randomised so every tensor is distinct."""
    method = build_method("dflash", block_size=B, aux_layers=aux, num_layers=num_layers)
    model = method.build(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    method.save(model, str(root / "head"), target)
    return model.eval(), root / "head"


@pytest.fixture(scope="module")
def exported(target, target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    model, head = make_dflash(target, root, num_layers=2)
    return model, export_head(head, root / "out", "all", str(target_dir))


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _shapes(folder: Path) -> dict[str, tuple]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


# --------------------------------------------------------------------------- the engines' modules, from the config


def engine_params(engine: str, c: dict, fc_in: int, file_names=()) -> dict[str, tuple]:
    """Parameters of the engine's DFlash module that must come from the file (vLLM ``DFlashQwen3ForCausalLM``,
    SGLang ``DFlashDraftModel``), built from the parsed config; vLLM's optional ones only when the file has them."""
    h, i, nh, nkv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // nh
    pre = "model." if engine == "vllm" else ""
    p = {f"{pre}fc.weight": (h, fc_in), f"{pre}hidden_norm.weight": (h,), f"{pre}norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        q = f"{pre}layers.{n}."
        p.update({q + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, h), q + "self_attn.o_proj.weight": (h, nh * hd),
                  q + "self_attn.q_norm.weight": (hd,), q + "self_attn.k_norm.weight": (hd,),
                  q + "mlp.gate_up_proj.weight": (2 * i, h), q + "mlp.down_proj.weight": (h, i),
                  q + "input_layernorm.weight": (h,), q + "post_attention_layernorm.weight": (h,)})
    if engine == "vllm":  # optional: the target's are shared unless the file ships them
        if "embed_tokens.weight" in file_names:
            p["model.embed_tokens.weight"] = (c["vocab_size"], h)
        if "lm_head.weight" in file_names:
            p["lm_head.weight"] = (c.get("draft_vocab_size") or c["vocab_size"], h)
    return p


def engine_load(engine: str, names: dict[str, tuple], params: dict[str, tuple]) -> dict[str, tuple]:
    """The engine loader's name rules applied to the file; stacked shards sum their rows. vLLM raises on a key
    with no destination (AutoWeightsLoader); SGLang drops it silently, so the result then lacks a parameter."""
    loaded: dict[str, tuple] = {}
    for name, shape in names.items():
        if engine == "vllm":
            if "t2d" in name:
                continue
            dest = name if "lm_head" in name else "model." + name
        else:
            dest = name.removeprefix("model.")
        for shard, stacked in facts.VLLM_DFLASH["stacked"].items():
            if shard + "." in dest:
                dest = dest.replace(shard + ".", stacked + ".")
                if dest in loaded:
                    shape = (loaded[dest][0] + shape[0], *shape[1:])
        if dest not in params:
            if engine == "vllm" and facts.VLLM_DFLASH["unknown_key"] == "error":
                raise AssertionError(f"vLLM: There is no module or parameter named {dest!r}")
            continue  # SGLang: "Ignore unexpected weights"
        loaded[dest] = tuple(shape)
    return loaded


# --------------------------------------------------------------------------- the checks


def check_format_a(folder: Path, aux=AUX, num_layers: int = LAYERS, engines=("vllm", "sglang")) -> None:
    """The z-lab folder against vLLM 0.34 and SGLang 0.5.23: what they parse, capture, build and load."""
    c = _config(folder)
    hf = AutoConfig.from_pretrained(folder)  # both engines parse config.json with transformers first
    assert hf.model_type == "qwen3" and c["architectures"] == [facts.VLLM_DFLASH["architecture"]]
    assert facts.SGLANG_DFLASH["architecture"] == facts.VLLM_DFLASH["architecture"]
    assert not hf.tie_word_embeddings and hf.vocab_size == V
    assert hf.rope_parameters["rope_theta"] == c["rope_theta"] != facts.VLLM_DFLASH["rope_theta_default"]
    L = c["num_hidden_layers"]
    assert hf.layer_types == ["full_attention"] * L
    # Captured target states (our layer ids, concatenation order) = the trained aux layers, ascending.
    assert facts.vllm_dflash_captured_layers(c, num_layers) == sorted(aux), "vLLM captures other layers"
    if "sglang" in engines:
        assert facts.sglang_dflash_captured_layers(c, num_layers) == sorted(aux), "SGLang captures other layers"
    # Bidirectional attention in every layer, as trained.
    assert not any(facts.vllm_dflash_layer_causal(c, n) for n in range(L)), "vLLM would run causal layers"
    assert not any(facts.sglang_dflash_layer_causal(c, n) for n in range(L)), "SGLang would run causal layers"
    mask = c["dflash_config"]["mask_token_id"]
    assert 0 <= mask < V and c["block_size"] == B
    # Every parameter of both engines' modules loaded from the file, nothing unknown (vLLM raises, SGLang drops).
    names = _shapes(folder)
    fc_in = facts.vllm_dflash_fc_in(c, num_layers)
    for engine in engines:
        if engine == "sglang":
            assert fc_in == len(facts.sglang_dflash_target_layer_ids(c, num_layers)) * c["hidden_size"]
        params = engine_params(engine, c, fc_in, names)
        assert engine_load(engine, names, params) == params, f"{engine} would not load every parameter"
    assert "embed_tokens.weight" not in names and "lm_head.weight" not in names  # the target's are shared


def check_speculators(folder: Path, target, aux=AUX, num_layers: int = LAYERS) -> None:
    """speculators' folder against vLLM 0.34's own conversion (validate, then update_dflash)."""
    c = _config(folder)
    for path in facts.VLLM_SPECULATORS_REQUIRED:  # validate_speculators_config
        node = c
        for key in path:
            node = node[key]
    assert c["speculators_model_type"] == "dflash" and c["speculators_config"]["algorithm"] == "dflash"
    for key in facts.VLLM_SPECULATORS_DFLASH["required"]:
        assert key in c, key
    draft = facts.vllm_speculators_dflash_to_draft_config(c)
    assert draft["architectures"] == [facts.VLLM_DFLASH["architecture"]]
    assert facts.vllm_dflash_captured_layers(draft, num_layers) == sorted(aux), "vLLM captures other layers"
    L = draft["num_hidden_layers"]
    assert not any(facts.vllm_dflash_layer_causal(draft, n) for n in range(L)), "vLLM would run causal layers"
    # speculators' own config defaults the flag to false (every layer causal in vLLM): it must be in the file.
    as_speculators_writes = dict(facts.VLLM_SPECULATORS_DFLASH["speculators_writes_by_default"], **c)
    assert not facts.vllm_speculators_dflash_to_draft_config(as_speculators_writes)["dflash_config"]["causal"], \
        "sliding_window_non_causal missing: speculators' default (false) makes vLLM run causal layers"
    assert c["sample_from_anchor"] is False  # vLLM rejects sample_from_anchor for DFlash
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == c["block_size"] - 1
    assert draft["dflash_config"]["mask_token_id"] == c["mask_token_id"] < V
    names = _shapes(folder)
    params = engine_params("vllm", draft, facts.vllm_dflash_fc_in(draft, num_layers), names)
    assert engine_load("vllm", names, params) == params, "vLLM would not load every parameter"
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(names)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), target.model.get_input_embeddings().weight)
        assert torch.equal(f.get_tensor("lm_head.weight"), target.lm_head.weight)


# --------------------------------------------------------------------------- tests


def test_head_table_matches_the_dflash_model(target, tmp_path):
    model, _ = make_dflash(target, tmp_path, num_layers=2)
    table = {k: s.shape for k, s in head_tensors("dflash", model.config.to_dict()).items()}
    assert table == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_dflash_layouts_load_like_the_engines(exported, target):
    _, out = exported
    assert sorted(p.name for p in out.iterdir()) == ["sglang", "speculators", "vllm"]
    for sub in ("vllm", "sglang"):
        check_format_a(out / sub)
        assert _config(out / sub)["dflash_config"]["target_layer_ids"] == [0, 1, 2]  # ours minus one
    assert _config(out / "vllm") == _config(out / "sglang")  # one z-lab folder, served by both
    check_speculators(out / "speculators", target)
    assert _config(out / "speculators")["aux_hidden_state_layer_ids"] == [1, 2, 3]  # ours


@pytest.mark.parametrize("sub", ["vllm", "sglang", "speculators"])
def test_round_trip_to_an_equal_dflash_model(exported, target, sub):
    from specheads.models.dflash import DFlashModel, block_attention_mask

    model, out = exported
    back = load_exported(out / sub)
    skip = ("architectures", "transformers_version")
    assert type(back) is DFlashModel
    assert ({k: v for k, v in back.config.to_dict().items() if k not in skip}
            == {k: v for k, v in model.config.to_dict().items() if k not in skip})
    ours = model.state_dict()
    assert back.state_dict().keys() == ours.keys()
    assert all(torch.equal(v, ours[k]) for k, v in back.state_dict().items())
    # The engines concatenate the captured states in ascending layer order: same fused context as the head's.
    g = torch.Generator().manual_seed(1)
    feats = {layer: torch.randn(1, 6, H, generator=g) for layer in AUX}
    with safe_open(str(out / sub / "model.safetensors"), "pt") as f:
        fc = f.get_tensor("fc.weight")
    # float32 sums in two kernels' orders (a matmul here, the head's Linear there): float32's own tolerance
    # (differences ~1e-6 on ~1 values); a wrong layer order would differ by ~1.
    torch.testing.assert_close(torch.cat([feats[i] for i in sorted(AUX)], -1) @ fc.T,
                               model.fc(torch.cat([feats[i] for i in AUX], -1)), rtol=1.3e-6, atol=1e-5)
    # Same block logits.
    with torch.no_grad():
        logits = []
        for m in (model, back.attach(target)):
            cache = m.extend_context(m.new_cache(), m.fuse(torch.cat([feats[i] for i in AUX], -1)),
                                     torch.arange(6)[None])
            block = m.block_inputs(torch.tensor([[7]]))[:, 0]
            mask = block_attention_mask(torch.tensor([[6]]), B, 6)
            logits.append(m.logits(m.decode(block, torch.arange(6, 6 + B)[None], cache, mask)))
    assert torch.equal(*logits)


def test_cards_give_both_engines_commands(exported):
    _, out = exported
    a, s, sp = ((out / e / "README.md").read_text() for e in ("vllm", "sglang", "speculators"))
    vllm_cmd = '--speculative-config \'{"method": "dflash", "model": "%s", "num_speculative_tokens": 3}\''
    sglang_cmd = ("--speculative-algorithm DFLASH --speculative-draft-model-path %s "
                  "--speculative-num-draft-tokens 4")
    folder = "<path-or-repo-id-of-this-folder>"  # never a path of the exporting machine
    for card in (a, s):
        assert vllm_cmd % folder in card and sglang_cmd % folder in card  # the same folder serves both
        assert "dflash_config.target_layer_ids [0, 1, 2]" in card and str(out) not in card
    assert vllm_cmd % folder in sp and "SGLang cannot read this folder" in sp
    assert "not SGLang" in sp and "--speculative-algorithm DFLASH" in sp


def test_dflash_export_refusals(target, target_dir, tmp_path):
    _, head = make_dflash(target, tmp_path / "a", aux=(0, 2, 3))
    with pytest.raises(ExportError, match="SGLang 0.5.23 refuses"):
        export_head(head, tmp_path / "o1", "sglang", str(target_dir))
    out = export_head(head, tmp_path / "o2", "vllm", str(target_dir))  # vLLM: -1 + 1 = 0, the embedding output
    check_format_a(out, aux=(0, 2, 3), engines=("vllm",))
    with pytest.raises(ValueError, match="out-of-range layer id -1"):  # what SGLang would say to this folder
        facts.sglang_dflash_captured_layers(_config(out), LAYERS)
    with pytest.raises(ExportError, match="drafts 1..3 tokens"):
        export_head(head, tmp_path / "o3", "vllm", str(target_dir), spec_tokens=4)
    other = make_tiny_target("llama", vocab=V, hidden=H, layers=6)
    other.model.save_pretrained(tmp_path / "six")
    with pytest.raises(ExportError, match="num_target_layers 4 != target"):
        export_head(head, tmp_path / "o4", "vllm", str(tmp_path / "six"))
    with pytest.raises(ExportError, match="medusa has no loader for dflash"):
        export_head(head, tmp_path / "o5", "medusa", str(target_dir))


def test_tied_target_lm_head_comes_from_the_embedding(tmp_path):
    tied = make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)
    tied.model.config.tie_word_embeddings = True
    tied.model.tie_weights()
    tied.model.save_pretrained(tmp_path / "tied")
    _, head = make_dflash(tied, tmp_path)
    out = export_head(head, tmp_path / "out", "speculators", str(tmp_path / "tied"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), tied.model.get_input_embeddings().weight)


def test_planted_bugs_are_caught(target, target_dir, tmp_path, monkeypatch):
    """Each bug the checks exist for, planted in the layout code, fails them."""
    _, head = make_dflash(target, tmp_path)

    def export(name, engine):
        return export_head(head, tmp_path / name, engine, str(target_dir))

    # 1. Our aux ids written as z-lab target_layer_ids (no minus one): both engines capture the next layers.
    with monkeypatch.context() as m:
        m.setattr(layouts, "dflash_target_layer_ids", lambda engine, aux: sorted(int(i) for i in aux))
        with pytest.raises(AssertionError, match="vLLM captures other layers"):
            check_format_a(export("ids", "vllm"))
    # 2. sliding_window_non_causal left out of the speculators folder, or false.
    for bad in ("missing", False):
        real = layouts._dflash_speculators

        def planted(*args, bad=bad, real=real):
            lay = real(*args)
            if bad == "missing":
                del lay.config["sliding_window_non_causal"]
            else:
                lay.config["sliding_window_non_causal"] = bad
            return lay

        with monkeypatch.context() as m:
            m.setattr(layouts, "_dflash_speculators", planted)
            with pytest.raises(AssertionError, match="causal"):
                check_speculators(export(f"swnc-{bad}", "speculators"), target)
    # 3. A misspelt weight name (vLLM: a load error; SGLang: silently dropped, the norm stays random).
    real_a = layouts._dflash

    def typo(*args):
        lay = real_a(*args)
        good, bad = "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.qnorm.weight"
        lay.tensors[bad], lay.rules[bad] = lay.tensors.pop(good), lay.rules.pop(good)
        return lay

    with monkeypatch.context() as m:
        m.setattr(layouts, "_dflash", typo)
        folder = export("typo", "sglang")
        with pytest.raises(AssertionError, match="no module or parameter named 'model.layers.0.self_attn.qnorm"):
            check_format_a(folder)
        c, names = _config(folder), _shapes(folder)
        params = engine_params("sglang", c, facts.vllm_dflash_fc_in(c, LAYERS))
        assert "layers.0.self_attn.q_norm.weight" not in engine_load("sglang", names, params)


def test_docs_state_dflash_support():
    doc = " ".join((REPO / "docs" / "export.md").read_text().split())
    row = next(line for line in (REPO / "docs" / "export.md").read_text().splitlines() if line.startswith("| DFlash |"))
    cells = [c.strip() for c in row.strip("|").split("|")]  # head, vLLM 0.34, SGLang 0.5.23, vLLM 0.32/0.33, ...
    assert "`vllm/`" in cells[1] and "`speculators/`" in cells[1]
    assert "`sglang/`" in cells[2] and "not `speculators/`" in cells[2]
    assert cells[3].startswith("`vllm/` loads and drafts in the 0.32.0 CPU build")  # served for real (docs/serving.md)
    assert facts.SGLANG_DFLASH["reads_speculators_format"] is False and facts.CHECKED_DFLASH["vllm"] == ("0.34.0",)
    assert "our aux layers − 1" in doc and "sliding_window_non_causal: true" in doc
