"""Synthetic prepared data and a tiny Llama for engine tests; also run as a script by the resume test.

    python tests/training/engine_helpers.py OUT_DIR MAX_STEPS SLEEP_PER_BATCH [ASYNC_CHECKPOINT]
trains Medusa-1 on the tiny target with checkpoints every 2 steps (sleeping per batch so a test can
kill it mid-run; ``train.async_checkpoint`` auto unless given) and writes OUT_DIR/metrics.jsonl.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.conftest


def word_level_target(root: Path, layers: int, rows: int = 40) -> tuple[Path, Path]:
    """(a tiny Llama folder with a 256-word word-level tokenizer, a prepared folder of ``rows`` progressions
    tokenized 'by' it) under ``root``: a target and data the CLI stages load as a user's."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specheads.data.prepare import write_prepared
    from specheads.targets import tokenizer_fingerprint
    from tests.conftest import make_tiny_model

    model_dir = root / "tiny-llama"
    make_tiny_model("llama", hidden=32, layers=layers, vocab=256).save_pretrained(model_dir)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)},
                                                                              unk_token="w0")),
                                  unk_token="w0", eos_token="w1")
    tok.save_pretrained(model_dir)
    prepared = root / "prepared"
    write_prepared(progression_rows(rows), {"target": str(model_dir), "tokenizer_fingerprint": tokenizer_fingerprint(tok),
                                            "max_length": 32}, prepared)
    return model_dir, prepared


def progression_rows(n: int, length: int = 24, vocab: int = 256, seed: int = 0, prompt: int = 4) -> dict[str, list]:
    """Arithmetic progressions mod ``vocab`` (stride 1-3): learnable by heads that see the current token.

    The first ``prompt`` tokens of each row have loss_mask 0 (a stand-in for the user turn).
    """
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for i in range(n):
        start = int(torch.randint(0, vocab, (1,), generator=g))
        stride = 1 + i % 3
        T = length - int(torch.randint(0, length // 4, (1,), generator=g))
        ids.append([(start + stride * j) % vocab for j in range(T)])
        masks.append([0] * prompt + [1] * (T - prompt))
    return {"id": [f"s{i}" for i in range(n)], "input_ids": ids, "loss_mask": masks,
            "domain": ["synthetic"] * n}


def token_dataset(n: int, seed: int = 0, **kw):
    """A ``TokenDataset`` (the online-mode input) over synthetic rows."""
    import datasets

    from specheads.data.features import TokenDataset

    return TokenDataset(datasets.Dataset.from_dict(progression_rows(n, seed=seed, **kw)))


def sources(n_train: int = 48, n_eval: int = 16, max_tokens: int = 192, seed: int = 0):
    """(train, held-out) ``DatasetBatches`` over disjoint synthetic rows."""
    from specheads.training.batches import DatasetBatches

    ds = token_dataset(n_train + n_eval, seed=seed)
    train = DatasetBatches(ds, max_tokens=max_tokens, seed=seed, indices=range(n_train))
    held = DatasetBatches(ds, max_tokens=512, shuffle=False, indices=range(n_train, n_train + n_eval))
    return train, held


class SlowSource:
    """Wrap a source and sleep per batch, so a killer can land anywhere in a step."""

    def __init__(self, inner, sleep: float):
        self.inner, self.sleep = inner, sleep

    def batches(self, epoch: int, start: int = 0):
        for b in self.inner.batches(epoch, start):
            time.sleep(self.sleep)
            yield b


def main(out_dir: str, max_steps: int, sleep: float, async_checkpoint: str = "auto") -> None:
    from tests.conftest import make_tiny_target
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train
    from specheads.methods.medusa import Medusa1Method
    from specheads.targets import end_process_group

    torch.set_num_threads(1)
    target = make_tiny_target("llama", hidden=32, layers=2, vocab=256)
    train_src, held = sources()
    cfg = TrainConfig(output_dir=out_dir, max_steps=max_steps, grad_accum=2, save_every=2, eval_every=0,
                      wandb_mode="disabled", progress=False, async_checkpoint=async_checkpoint)
    train(Medusa1Method(num_heads=3), target, SlowSource(train_src, sleep), cfg,
          OptimConfig(lr=3e-3, warmup_steps=3), held)
    end_process_group()  # as the train recipe does


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:5])
