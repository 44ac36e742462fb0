"""Benchmark hidden-state collection against a bare forward pass, and the store's dtypes.

    python scripts/bench/bench_collect.py --prepared runs/default/prepared --samples 16 --max-length 256
    python scripts/bench/bench_collect.py --target /models/Llama-3.1-8B-Instruct --device cuda --dtype-target bfloat16 \
        --samples 512 --max-length 2048 --batch-tokens 16384

1. throughput: the same length-sorted batches that collection plans go through (a) a bare decoder
   forward (no hooks, no copies, nothing written) and (b) a whole ``collect_hidden_states`` call into
   a fresh store (planning, forward + feature capture, dtype conversion, hashing, writing, manifest;
   without the optional one-batch time estimate). Reported as tokens/s and the ratio (a)/(b) of
   times (goal >= 0.9), by wall time (fastest of the repeats) and by this process's CPU time.
2. dtypes: float32 features computed once, written as a store in each dtype; bytes/token on disk,
   relative error of the read-back features, and the fidelity of the target distribution that
   EAGLE-3 recomputes from the stored last state (KL to the float32 logits, top-1 agreement), and
   with --train-steps the loss of a short Medusa-1 training on each dtype's store.
Prints a JSON report (and writes it with --json).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from specheads.data.features import (
    CollectOptions, FeatureDataset, TokenDataset, collate_features, collect_hidden_states, compute_features,
    length_batches, plan_shards, spec_for_method,
)
from specheads.data.prepare import check_prepared_matches, load_prepared
from specheads.data.store import ShardWriter, bytes_per_token, canonical_dtype, read_manifest
from specheads.targets import load_target


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2", help="target name/path (default: the embedded SmolLM2)")
    p.add_argument("--dtype-target", default="float32", help="dtype the target runs in")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prepared", required=True, help="prepared dataset folder (specheads prepare)")
    p.add_argument("--samples", type=int, default=16, help="samples to use (spread over the dataset)")
    p.add_argument("--max-length", type=int, default=256, help="only samples of at most this many tokens")
    p.add_argument("--method", default="eagle3", help="medusa1 | eagle1 | eagle3: which features are stored")
    p.add_argument("--dtype", default="bfloat16", help="store dtype of the timed collection")
    p.add_argument("--compare-dtypes", default="float32,bfloat16,float16,fp8_e4m3",
                   help="store dtypes for the bytes/token and fidelity table ('' to skip)")
    p.add_argument("--train-steps", type=int, default=0,
                   help="also train a 2-head Medusa-1 this many steps on each dtype's store and report the loss")
    p.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per forward")
    p.add_argument("--repeats", type=int, default=2, help="alternating bare/collect rounds (fastest kept)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--workdir", default=None, help="where stores are written (default: a temp folder)")
    p.add_argument("--json", default=None, help="also write the report to this file")
    return p.parse_args(argv)


def pick_rows(dataset, n: int, max_length: int) -> list[int]:
    """Up to n rows of at most max_length tokens, spread evenly over the dataset."""
    lengths = TokenDataset(dataset).lengths
    ok = [i for i, L in enumerate(lengths) if L <= max_length]
    if not ok:
        raise SystemExit(f"no sample of at most {max_length} tokens; raise --max-length")
    step = max(1, len(ok) // n)
    return ok[::step][:n]


def planned_batches(tokens: TokenDataset, opts: CollectOptions, bpt: int) -> list[dict[str, torch.Tensor]]:
    """The batches collection will run, in its order (built up front: the bare pass times only the model)."""
    shards = plan_shards(tokens.lengths, max(1, opts.shard_bytes // bpt), opts.shard_samples)
    rows = [b for s in shards for b in length_batches(s, tokens.lengths, opts.batch_tokens, opts.max_batch_size)]
    return [collate_features(tokens.rows(b)) for b in rows]


@torch.no_grad()
def bare_pass(target, batches) -> tuple[float, float]:
    """(wall, CPU) seconds of a plain decoder forward over the batches (the floor collection is measured against)."""
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for b in batches:
        target.decoder(input_ids=b["input_ids"].to(target.device),
                       attention_mask=b["attention_mask"].to(target.device), use_cache=False)
    sync()
    return time.perf_counter() - t0, time.process_time() - c0


def throughput(target, dataset, spec, opts, work: Path, repeats: int) -> dict:
    """Bare pass and collection alternated ``repeats`` times (ABBA order); the fastest of each is compared (on a
    shared machine the minimum is the least disturbed). CPU seconds (all threads of this process,
    the writer's included) are reported too: other processes inflate wall time, not this one's CPU time."""
    tokens = TokenDataset(dataset)
    bpt = bytes_per_token(target.hidden_size, len(spec.aux_layers), spec.need_last, opts.dtype)
    batches = planned_batches(tokens, opts, bpt)
    n_tokens = sum(tokens.lengths)
    bare_pass(target, batches[:1])  # warm-up
    bare, coll = [], []

    def timed_collect(r: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        collect_hidden_states(target, dataset, spec, work / f"timed-{opts.dtype}-{r}", opts)
        return time.perf_counter() - t0, time.process_time() - c0

    for r in range(repeats):  # A B B A ...: neither side always runs first
        if r % 2 == 0:
            bare.append(bare_pass(target, batches))
            coll.append(timed_collect(r))
        else:
            coll.append(timed_collect(r))
            bare.append(bare_pass(target, batches))
    best_bare, best_coll = min(w for w, _ in bare), min(w for w, _ in coll)
    return {
        "samples": len(tokens), "tokens": n_tokens, "padded_tokens": sum(b["input_ids"].numel() for b in batches),
        "batches": len(batches), "repeats": repeats,
        "bare_wall_s": [round(w, 2) for w, _ in bare], "collect_wall_s": [round(w, 2) for w, _ in coll],
        "bare_cpu_s": [round(c, 2) for _, c in bare], "collect_cpu_s": [round(c, 2) for _, c in coll],
        "bare_tokens_per_s": round(n_tokens / best_bare, 1),
        "collect_tokens_per_s": round(n_tokens / best_coll, 1),
        "ratio_wall": round(best_bare / best_coll, 3),
        "ratio_cpu": round(min(c for _, c in bare) / min(c for _, c in coll), 3),
    }


@torch.no_grad()
def dtype_table(target, dataset, spec, dtypes: list[str], opts: CollectOptions, work: Path,
                train_steps: int = 0) -> dict:
    """Write the same float32 features in each dtype; bytes/token and read-back fidelity per dtype."""
    tokens = TokenDataset(dataset)
    order = sorted(range(len(tokens)), key=lambda i: (tokens.lengths[i], i))
    ids = [tokens[i]["id"] for i in order]
    feats = [compute_features(target, collate_features(tokens.rows(b)), spec)
             for b in length_batches(order, tokens.lengths, opts.batch_tokens, opts.max_batch_size)]
    ref = {i: {k: v for k, v in tokens[i].items()} for i in order}
    row = 0
    for f in feats:  # float32 reference per sample, in storage order
        for b in range(f["input_ids"].shape[0]):
            n = int(f["attention_mask"][b].sum())
            ref[order[row]].update({k: f[k][b, :n] for k in ("hidden_last", "hidden_aux") if k in f})
            row += 1
    table = {}
    for dtype in dtypes:
        root = work / f"table-{dtype}"
        store_from_features(root, target, spec, dtype, feats, ids)
        table[dtype] = fidelity(target, FeatureDataset(root), ref, tokens)
        if train_steps:
            table[dtype]["medusa1_train_loss"] = short_training(target, FeatureDataset(root), opts, train_steps)
    return table


def short_training(target, ds: FeatureDataset, opts: CollectOptions, steps: int) -> dict:
    """Train a 2-head Medusa-1 (the real method and loss) for ``steps`` AdamW steps on this store's
    features, same seed and batches for every dtype; loss at the start, the end, and its last-5 mean."""
    from specheads.methods import build_method

    torch.manual_seed(0)
    method = build_method("medusa1", num_heads=2)
    model = method.build(target).train()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    order = sorted(range(len(ds)), key=lambda i: (ds.lengths[i], ds.ids[i]))
    batches = [collate_features([ds[i] for i in b])
               for b in length_batches(order, ds.lengths, opts.batch_tokens, opts.max_batch_size)]
    with torch.enable_grad():  # called from the no-grad dtype table
        losses = [train_step(method, model, optim, batches[step % len(batches)], target) for step in range(steps)]
    return {"first": round(losses[0], 4), "last": round(losses[-1], 4),
            "last5_mean": round(sum(losses[-5:]) / len(losses[-5:]), 4)}


def train_step(method, model, optim, batch, target) -> float:
    batch = {k: v.to(target.device) for k, v in batch.items()}
    loss = method.loss(model, batch, target).loss
    optim.zero_grad()
    loss.backward()
    optim.step()
    return float(loss.detach())


def store_from_features(root: Path, target, spec, dtype: str, feats, ids) -> None:
    """One shard in ``dtype`` written by the collection's ShardWriter, plus a minimal manifest."""
    from specheads.data.features import finalize_store, open_plan

    writer = ShardWriter(root, canonical_dtype(dtype), max(1, len(spec.aux_layers)), "bench")
    for f in feats:
        writer.add(f)
    writer.finish(0, ids)
    writer.close()
    header = {"format": "specheads.features/1", "target": target.name, "num_shards": 1, "plan_hash": "bench",
              "hidden_size": target.hidden_size, "aux_layers": list(spec.aux_layers), "has_last": spec.need_last,
              "dtype": canonical_dtype(dtype),
              "bytes_per_token": bytes_per_token(target.hidden_size, len(spec.aux_layers), spec.need_last, dtype)}
    open_plan(root, header)
    finalize_store(root)


def fidelity(target, ds: FeatureDataset, ref: dict, tokens: TokenDataset) -> dict:
    """Bytes/token on disk; relative L2 error of features; KL(p32 || p) and top-1 agreement of lm_head(last)."""
    m = read_manifest(ds.root)
    n_tok = sum(ds.lengths)
    index = {tokens[i]["id"]: i for i in ref}
    err = {"hidden_last": [0.0, 0.0], "hidden_aux": [0.0, 0.0]}
    kl, agree = 0.0, 0
    for j in range(len(ds)):
        item, want = ds[j], ref[index[ds.ids[j]]]
        for k in err:
            if k in item:
                err[k][0] += float((item[k] - want[k]).pow(2).sum())
                err[k][1] += float(want[k].pow(2).sum())
        if "hidden_last" in item:
            dev = target.device
            lp_ref = torch.log_softmax(target.logits(want["hidden_last"].to(dev, target.dtype)).float(), -1)
            lp = torch.log_softmax(target.logits(item["hidden_last"].to(dev, target.dtype)).float(), -1)
            kl += float((lp_ref.exp() * (lp_ref - lp)).sum())
            agree += int((lp_ref.argmax(-1) == lp.argmax(-1)).sum())
    out = {"bytes_per_token_on_disk": round(m["bytes_on_disk"] / n_tok, 1),
           "bytes_per_token_payload": m["bytes_per_token"]}
    for k, (num, den) in err.items():
        if den:
            out[f"rel_err_{k}"] = float(f"{(num / den) ** 0.5:.3g}")
    if "hidden_last" in ds[0]:
        out["target_kl_per_token"] = float(f"{kl / n_tok:.3g}")
        out["target_top1_agreement"] = round(agree / n_tok, 5)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, args.dtype_target, args.device)
    dataset, meta = load_prepared(args.prepared)
    check_prepared_matches(meta, target)
    dataset = dataset.select(pick_rows(dataset, args.samples, args.max_length))
    spec = spec_for_method(args.method, target.num_layers)
    # the timed calls do everything collection does except the optional one-batch time estimate
    opts = CollectOptions(dtype=canonical_dtype(args.dtype), batch_tokens=args.batch_tokens, estimate_time=False)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_collect_"))
    shutil.rmtree(work, ignore_errors=True)
    try:
        report = {"target": args.target, "device": args.device, "target_dtype": args.dtype_target,
                  "threads": torch.get_num_threads(), "method": args.method, "aux_layers": list(spec.aux_layers),
                  "store_dtype": opts.dtype, "batch_tokens": args.batch_tokens,
                  "throughput": throughput(target, dataset, spec, opts, work, args.repeats)}
        dtypes = [canonical_dtype(d) for d in args.compare_dtypes.split(",") if d]
        if dtypes:
            report["dtypes"] = dtype_table(target, dataset, spec, dtypes, opts, work, args.train_steps)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
