import pytest
import torch
from safetensors.torch import load_file

from specheads.models.medusa import MedusaConfig, MedusaHeads, medusa_for_target


def test_fresh_heads_are_identity_blocks_with_the_target_lm_head(tiny_target):
    heads = medusa_for_target(tiny_target, num_heads=3, num_layers=2)
    hidden = torch.randn(2, 7, tiny_target.hidden_size)
    logits = heads(hidden)
    assert logits.shape == (3, 2, 7, tiny_target.vocab_size)
    for k in range(3):  # every head starts as the target's own next-token predictor
        torch.testing.assert_close(logits[k], tiny_target.logits(hidden))
    assert heads.config.target_config_hash == tiny_target.config_hash()


def test_vllm_weight_names_and_round_trip(tmp_path, tiny_target):
    heads = medusa_for_target(tiny_target, num_heads=2, num_layers=1, bias=True)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.normal_()
    heads.save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert names == {"blocks.0.layers.0.weight", "blocks.0.layers.0.bias", "blocks.1.layers.0.weight",
                     "blocks.1.layers.0.bias", "lm_heads.0.weight", "lm_heads.1.weight"}
    back = MedusaHeads.from_pretrained(tmp_path)
    assert back.config.medusa_fc_bias is True and back.config.num_hidden_layers == 1
    h = torch.randn(1, 5, tiny_target.hidden_size)
    torch.testing.assert_close(back(h), heads(h))


def test_bias_is_optional_and_config_checks_inputs(tiny_target):
    heads = medusa_for_target(tiny_target, num_heads=1, bias=False)
    assert heads.blocks[0].layers[0].bias is None and heads.config.medusa_fc_bias is False
    with pytest.raises(ValueError, match="num_heads >= 1"):
        MedusaConfig(num_heads=0)
    with pytest.raises(NotImplementedError, match="truncated"):
        MedusaConfig(vocab_size=100, truncated_vocab_size=50)
    wrong = MedusaHeads(MedusaConfig(hidden_size=tiny_target.hidden_size, vocab_size=7, num_heads=1))
    with pytest.raises(ValueError, match="LM head"):
        wrong.init_from_target(tiny_target)


def test_residual_block_is_x_plus_silu_linear():
    heads = MedusaHeads(MedusaConfig(hidden_size=4, vocab_size=6, num_heads=1, num_hidden_layers=1))
    lin = heads.blocks[0].layers[0]
    with torch.no_grad():
        lin.weight.copy_(torch.eye(4))
        lin.bias.fill_(0.5)
    x = torch.randn(3, 4)
    torch.testing.assert_close(heads.head_hidden(x, 0), x + torch.nn.functional.silu(x + 0.5))
