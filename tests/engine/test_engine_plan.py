"""The engine tier for ``specheads plan plan.engine=vllm``: vLLM's collection rate measured here on random weights
of the target's shape (nothing downloaded), priced beside the transformers forward's. About a minute (one engine
load)."""

from __future__ import annotations

import json
import re

import pytest

from tests.engine.conftest import specheads

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_plan_prices_collection_by_vllm_measured_here(tmp_path):
    out = specheads("plan", "plan.engine=vllm", "plan.num_samples=100", "plan.probe_tokens=8",
                    f"plan.json={tmp_path / 'plan.json'}", "plan.disk_dir=.", cwd=tmp_path)
    line = next(row for row in out.stdout.splitlines() if "collect by vLLM" in row)
    shape = r"vLLM 0\.\d+\.\d+ measured here on random weights of this shape, (bfloat16|float32): \d+ tokens/s"
    assert re.search(shape, line), line
    saved = json.loads((tmp_path / "plan.json").read_text())["engine"]
    assert saved["tokens_per_s"] > 0 and saved["load_s"] > 0
    assert saved["collect_s"] > saved["load_s"]
