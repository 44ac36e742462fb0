"""A target split over 2 GPUs (tensor parallel over NCCL, and device_map layers) gives the whole target's
features. Skipped without 2 CUDA devices; the CPU runs of the same checks are test_tensor_parallel.py
(TP over gloo works on CPU: transformers 5.24, torch 2.13) and test_layout.py (device_map on CPU).
"""

from __future__ import annotations

import json

import pytest
import torch

from specheads.data.features import TokenDataset, collate_features, compute_features
from specheads.data.prepare import load_prepared
from specheads.methods.base import FeatureSpec
from specheads.targets import load_target

from parallel_helpers import PYTHON, free_port, prepared_dir, run, tiny_model_dir

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (the CPU equivalents "
                                 "run in test_tensor_parallel.py and test_layout.py)")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    model = tiny_model_dir(root)
    return model, prepared_dir(root, model, n=40)


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_device_map_spreads_the_layers_over_two_gpus_with_the_same_features(tiny):
    model, prepared = tiny
    placed = load_target(str(model), parallel="device_map")
    devices = {p.device for p in placed.model.parameters()}
    assert devices == {torch.device("cuda", 0), torch.device("cuda", 1)}, devices
    assert placed.device == torch.device("cuda", 0)
    whole = load_target(str(model), device="cuda:0")
    rows, _ = load_prepared(prepared)
    batch = collate_features(TokenDataset(rows).rows(range(8)))
    spec = FeatureSpec(aux_layers=(1, 3, 5), need_last=True)
    a, b = compute_features(placed, batch, spec), compute_features(whole, batch, spec)
    for k in ("hidden_last", "hidden_aux"):
        assert a[k].device == torch.device("cuda", 0)  # gathered onto the input's device
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-5), k
    logits = placed.logits(a["hidden_last"])
    assert logits.device == a["hidden_last"].device
    assert torch.allclose(logits, whole.logits(b["hidden_last"]), rtol=0, atol=1e-4)


def test_tensor_parallel_over_two_gpus_gives_the_same_features_and_losses(tiny, tmp_path):
    from tp_worker import train_online

    model, prepared = tiny
    run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "tests/parallel/tp_worker.py", str(model), str(prepared), str(tmp_path / "tp"), "eagle3"])
    reports = [json.loads((tmp_path / "tp" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rep in reports:
        assert rep["q_proj_local_rows"] == 32 and rep["borrowed_plain"] and max(rep["diff"].values()) < 1e-4
    whole = train_online(load_target(str(model), device="cuda:0"), str(prepared), str(tmp_path / "whole"), "eagle3")
    split = {int(k): v for k, v in reports[0]["losses"].items()}
    assert all(abs(split[k] - whole[k]) < 1e-3 * abs(whole[k]) for k in whole), (split, whole)
