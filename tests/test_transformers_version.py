"""transformers older than 5.0 has no `rope_parameters`: specheads refuses it loudly instead of
building drafters whose RoPE silently differs from the target's."""

import importlib.util
import sys

import pytest
import transformers

from specheads.models import layers
from specheads.models.layers import MIN_TRANSFORMERS, check_transformers_version


def test_floor_is_the_first_version_with_rope_parameters():
    assert MIN_TRANSFORMERS == "5.0"


@pytest.mark.parametrize("version", ["4.56.0", "4.57.6", "4.99.0.dev0", "3.5.1"])
def test_older_versions_are_refused_with_a_clear_message(version):
    with pytest.raises(ImportError, match=rf"transformers>=5\.0 \(found {version}\).*rope_parameters"):
        check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.0.0", "5.0.0rc1", "5.1.0.dev0", "5.24.0", "6.0"])
def test_supported_versions_pass(version):
    check_transformers_version(version)


def test_the_installed_version_passes():
    check_transformers_version()


def test_importing_the_layers_on_4x_fails(monkeypatch):
    """The module itself checks at import, before any drafter can be built (a private copy is
    executed, so the real specheads.models.layers stays as it is for the other tests)."""
    # the module object `import transformers` binds now (transformers swaps its lazy module in sys.modules)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.6")
    spec = importlib.util.spec_from_file_location("_layers_on_old_transformers", layers.__file__)
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError, match=r"transformers>=5\.0 \(found 4\.57\.6\)"):
        spec.loader.exec_module(module)


def test_building_draft_fields_on_4x_fails(monkeypatch):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=100)
    assert layers.draft_fields_from_target(config)["rope_parameters"]["rope_type"] == "default"
    monkeypatch.setattr(layers.transformers, "__version__", "4.56.2")
    with pytest.raises(ImportError, match="rope_parameters"):
        layers.draft_fields_from_target(config)
