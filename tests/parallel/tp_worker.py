"""Run under torchrun by test_tensor_parallel.py: a tensor-parallel target against the whole one.

    torchrun --nproc_per_node 2 tests/parallel/tp_worker.py MODEL_DIR PREPARED_DIR OUT_DIR [METHOD]

Each rank loads the target split (``load_target(parallel="tp")``) and whole, compares their hidden
states on a padded batch of the prepared set (the features collection and online training use), then
trains METHOD (eagle3 or medusa1) a few steps on online features from the split target. Writes
OUT_DIR/rank{r}.json; the losses land in OUT_DIR/train/metrics.jsonl (``train_online`` below, which the
test also runs in one process on the whole target).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def build(method: str, prepared: str):
    from specheads.methods import build_method

    if method == "eagle3":
        return build_method("eagle3", draft_vocab_size=64, vocab_data=prepared, ttt_steps=2)
    return build_method("medusa1", num_heads=2)


def train_online(target, prepared: str, out: str, method: str = "eagle3", accelerator=None, steps: int = 3):
    """A few steps of ``method`` on online features of ``target``, with a held-out evaluation on the last
    4 rows (its metrics land in ``out/train_summary.json``); returns the losses."""
    from specheads.data.features import TokenDataset
    from specheads.data.prepare import load_prepared
    from specheads.training.batches import DatasetBatches
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train
    from specheads.training.run_log import read_losses

    rows, _ = load_prepared(prepared)
    data = TokenDataset(rows)
    n = len(data)
    source = DatasetBatches(data, max_tokens=96, seed=0, indices=range(n - 4))
    held = DatasetBatches(data, max_tokens=96, shuffle=False, indices=range(n - 4, n))
    cfg = TrainConfig(output_dir=out, max_steps=steps, save_every=0, eval_every=0, wandb_mode="disabled",
                      progress=False, measure_prompts=0)
    train(build(method, prepared), target, source, cfg, OptimConfig(lr=3e-3), held, accelerator)
    return read_losses(out)


def main(model_dir: str, prepared: str, out: str, method: str = "eagle3") -> None:
    from torch.distributed.tensor import DTensor

    from specheads.data.features import TokenDataset, collate_features, compute_features
    from specheads.data.prepare import load_prepared
    from specheads.methods.base import FeatureSpec
    from specheads.targets import load_target, parallel_layout
    from specheads.training.accelerator import make_accelerator
    from specheads.training.config import TrainConfig

    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # on GPUs: compare float32 with float32
    # As recipes/train.py does: the Accelerator (gloo process group) first, then the target.
    acc = make_accelerator(TrainConfig(output_dir=f"{out}/train", mixed_precision="no"))
    split = load_target(model_dir, "float32", parallel="tp")
    whole = load_target(model_dir, "float32", device=split.device)  # the CPU, or this rank's GPU
    layout = parallel_layout()

    rows, _ = load_prepared(prepared)
    batch = collate_features(TokenDataset(rows).rows(range(8)))  # 8 samples of different lengths: padded
    spec = FeatureSpec(aux_layers=(1, 3, 5), need_last=True)
    a, b = compute_features(split, batch, spec), compute_features(whole, batch, spec)
    diff = {k: (a[k] - b[k]).abs().max().item() for k in ("hidden_last", "hidden_aux")}
    ids = batch["input_ids"]
    diff["logits"] = (split.logits(a["hidden_last"]) - whole.logits(b["hidden_last"])).abs().max().item()
    diff["embed"] = (split.embed(ids) - whole.embed(ids)).abs().max().item()
    q = split.layers[0].self_attn.q_proj.weight
    report = {
        "layout": [layout.world, layout.rank, layout.tp_size, layout.dp_size, layout.dp_rank],
        "diff": diff,
        "q_proj_local_rows": q.to_local().shape[0] if isinstance(q, DTensor) else None,
        "q_proj_rows": q.shape[0],
        "borrowed_plain": not any(isinstance(m.weight, DTensor) for m in (split.lm_head, split.embed_tokens)),
        "config_hash_equal": split.config_hash() == whole.config_hash(),
    }
    del whole
    report["losses"] = train_online(split, prepared, f"{out}/train", method, acc)
    Path(out, f"rank{layout.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
