"""Fixtures of the multi-process tests: a tiny Llama model folder and a tiny prepared set on disk.

Launch helpers and evidence readers are in ``dist_launch.py``; see its docstring for what runs how.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dist_launch, for every test module here
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.conftest

from dist_launch import HIDDEN, LAYERS, ROW_LEN, VOCAB, Assets, equal_length_rows  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: starts several processes with accelerate launch (CPU, gloo)")


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Assets:
    """A tiny Llama saved as a local model folder (``load_target`` also needs a tokenizer: a 256-word
    WordLevel one, the smallest that ``AutoTokenizer`` loads) and a prepared set 'tokenized' by it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specheads.data.prepare import write_prepared
    from specheads.targets import tokenizer_fingerprint
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("distributed_assets")
    model_dir = root / "tiny-llama"
    make_tiny_model("llama", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS).save_pretrained(model_dir)
    words = {f"w{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w0")),
                                  unk_token="w0", eos_token="w1")
    tok.save_pretrained(model_dir)
    prepared = root / "prepared"
    write_prepared(equal_length_rows(), {"target": str(model_dir), "tokenizer_fingerprint": tokenizer_fingerprint(tok),
                                         "max_length": ROW_LEN}, prepared)
    return Assets(model_dir, prepared)


@pytest.fixture(scope="session")
def ddp_medusa1(assets, tmp_path_factory):
    """Medusa-1, 2 processes under conf/launcher/cpu_ddp.yaml, per-rank batch b = 9 rows, grad_accum 2, 6
    optimizer steps, checkpoints every 2: the DDP run of test_ddp_methods.py, the 2-process side of
    test_equivalence.py and the uninterrupted reference of test_resume.py."""
    from dist_launch import EQUIV_ARGS, launch, train_args

    out = tmp_path_factory.mktemp("ddp_medusa1") / "run"
    return launch("cpu_ddp.yaml", out, train_args(assets, out, "medusa1", *EQUIV_ARGS))
