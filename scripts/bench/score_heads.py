"""Score trained heads and bigram baselines on conversations that no head was trained on (run by hand).

    python scripts/bench/score_heads.py --prepared runs/big/prepared --skip runs/x/prepared \
        --head medusa1=runs/x/train/medusa1 --head eagle3=runs/x/train/eagle3 --max-rows 200

Rows of ``--prepared`` whose ids also appear in ``--skip`` (the training set) are left out; the
rest are cut to ``--max-length`` tokens, as training cut them. Each head is scored with its
training method's held-out evaluation (``Method.evaluate``, online features from the target):
Medusa head k top-1 against the data token and against the target's greedy token
(``head{k}_argmax_acc``), EAGLE step k against the target's argmax and against the data token
(``data{k}_acc``). Bigram baselines are fitted on every row of ``--skip`` (the data the
heads were trained on, so the baselines see at least as much) and scored on the same rows. The larger
held-out set makes the head-vs-bigram difference less noisy than the training run's small held-out
split; the standard error of each accuracy is printed beside it. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepared", required=True, help="prepared dataset to score on")
    p.add_argument("--skip", required=True, help="prepared dataset the heads were trained on (excluded; fits the bigrams)")
    p.add_argument("--head", action="append", default=[], metavar="METHOD=DIR",
                   help="a trained head: medusa1|eagle1|eagle3 = training output folder (holding head/)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--max-rows", type=int, default=200)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per evaluation batch")
    return p.parse_args(argv)


def load_head(method_name: str, folder: str, target):
    """(method, model) for a saved head, built as training built it."""
    from specheads.evaluation.suite import resolve_head_dir
    from specheads.methods import build_method

    head = resolve_head_dir(folder)
    if method_name == "medusa1":
        from specheads.models.medusa import MedusaHeads

        heads = MedusaHeads.from_pretrained(head).to(target.device).eval()
        return build_method("medusa1", num_heads=heads.config.num_heads), heads
    if method_name == "eagle1":
        from specheads.models.eagle1 import Eagle1Model

        return build_method("eagle1"), Eagle1Model.from_pretrained(head).to(target.device).eval().attach(target)
    if method_name == "eagle3":
        from specheads.models.eagle3 import Eagle3Model

        model = Eagle3Model.from_pretrained(head).to(target.device).eval().attach(target)
        method = build_method("eagle3", draft_vocab_size=model.config.draft_vocab_size,
                              aux_layers=list(model.config.aux_layers))
        return method.bind(target), model
    raise SystemExit(f"--head {method_name}=...: use medusa1, eagle1 or eagle3")


def main(argv=None) -> dict:
    args = parse_args(argv)
    from specheads.data.features import TokenDataset
    from specheads.data.prepare import load_prepared
    from specheads.targets import load_target
    from specheads.training.baselines import BigramBaseline
    from specheads.training.accelerator import make_accelerator
    from specheads.training.batches import DatasetBatches
    from specheads.training.config import TrainConfig
    from specheads.methods import TrainingModule
    from specheads.training.heldout import evaluate

    target = load_target(args.target)
    rows, _ = load_prepared(args.prepared)
    skip_rows, _ = load_prepared(args.skip)
    seen = set(map(str, skip_rows["id"]))
    # Unseen rows with at least one assistant token within max_length (as training would keep them).
    keep = [i for i, x in enumerate(rows["id"]) if str(x) not in seen
            and 1 in rows[i]["loss_mask"][: args.max_length]][: args.max_rows]
    if not keep:
        raise SystemExit(f"every row of {args.prepared} is in {args.skip}: nothing held out to score on")
    data = TokenDataset(rows)
    source = DatasetBatches(data, args.max_tokens, None, False, 0, keep, args.max_length)

    cut = lambda seqs: [list(s)[: args.max_length] for s in seqs]  # noqa: E731
    held_ids, held_masks = data.token_rows(keep)
    held_ids, held_masks = cut(held_ids), cut(held_masks)
    fit_ids, fit_masks = cut(skip_rows["input_ids"]), cut(skip_rows["loss_mask"])
    out: dict = {"rows": len(keep), "baselines": {}, "heads": {}}
    for d in (1, 2, 3):
        c, n = BigramBaseline(d).fit(fit_ids, fit_masks).accuracy(held_ids, held_masks)
        out["baselines"][f"bigram_d{d}_acc"] = _with_se(c / n if n else float("nan"), n)
    acc = make_accelerator(TrainConfig(output_dir=str(REPO / "runs" / ".score_heads"), wandb_mode="disabled"))
    for spec in args.head:
        name, _, folder = spec.partition("=")
        method, model = load_head(name, folder, target)
        metrics = evaluate(method, TrainingModule(method, model, target), target, source, acc)
        out["heads"][name] = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float) and k.endswith("_acc")}
        print(f"{name}: {json.dumps(out['heads'][name])}", file=sys.stderr)
    print(json.dumps(out, indent=1))
    return out


def _with_se(p: float, n: int) -> dict:
    return {"acc": round(p, 4), "se": round(math.sqrt(max(p * (1 - p), 1e-12) / max(n, 1)), 4), "n": n}


if __name__ == "__main__":
    main()
