"""The export tests' shared fixture: each module's tiny ``target`` (its own sizes) saved as a model folder."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("target") / "tiny-llama"
    target.model.save_pretrained(d)
    return d
