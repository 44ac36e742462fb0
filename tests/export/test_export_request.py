"""The export's own settings (engine names, dtype, the serve commands' chain length) are checked before any file
is read, and an output folder that cannot be one is refused before the head is read."""

from __future__ import annotations

import pytest

from specheads.errors import ConfigError
from specheads.export.checks import ExportError
from specheads.export.export import check_request, export_head


@pytest.mark.parametrize("engine, dtype, spec_tokens, words", [
    ("foo", None, None, "engine=foo: use one of vllm"),
    ("vllm,vllm", None, None, "engine=vllm,vllm"),
    ("all", "int4", None, "dtype=int4: use one of float32, bfloat16, float16"),
    ("all", None, 0, "spec_tokens=0: give an integer >= 1"),
    ("all", None, -2, "spec_tokens=-2"),
])
def test_a_bad_export_setting_is_refused(engine, dtype, spec_tokens, words):
    with pytest.raises(ExportError, match=words):
        check_request(engine, dtype, spec_tokens)


@pytest.mark.parametrize("engine, dtype, spec_tokens", [("all", None, None), ("both", "bfloat16", 3),
                                                         ("vllm, sglang", "float16", 1), ("speculators", None, None)])
def test_good_export_settings_pass(engine, dtype, spec_tokens):
    check_request(engine, dtype, spec_tokens)


def test_settings_and_the_output_folder_are_checked_before_the_head_is_read(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ExportError, match="spec_tokens=0"):
        export_head(tmp_path / "no-head", tmp_path / "out", spec_tokens=0)
    with pytest.raises(ConfigError, match="is a file"):
        export_head(tmp_path / "no-head", tmp_path / "f")
