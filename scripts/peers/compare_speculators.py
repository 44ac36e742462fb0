"""Benchmark our EAGLE-3 trainer against vLLM speculators' on the same target, data and settings (run by hand).

    PYTHONPATH=<folder holding speculators and its deps> python scripts/peers/compare_speculators.py \
        --features runs/quickstart/features --prepared runs/quickstart/prepared --minutes 2.5
    ... --settings float32:3 bfloat16:3 float32:1 bfloat16:1 --draft-vocab-size 4096 --json report.json
    ... --only ours                        # our trainer alone (speculators need not be installed)
    ... --settings bfloat16:1 --epochs 1 --evaluate --json h2h.json   # equal tokens (their default recipe),
                                                                       # then the acceptance of both heads
    ... --settings bfloat16:1 --epochs 1 --evaluate --their-arg=--no-norm-before-residual \
        --their-arg=--no-norm-before-fc --their-arg=--no-norm-output --their-arg=--full-attention-indices=0 \
        --json h2h-arch.json                # the same, their head in our architecture (the original EAGLE-3's)
    python scripts/peers/compare_speculators.py --reuse h2h.json --json h2h-eval.json   # evaluate those heads again
    python scripts/peers/compare_speculators.py --reuse h2h.json --serve --json h2h-served.json  # and serve them

speculators (pip install speculators, v0.9) is not a dependency of this project: without it the script
says so and skips its runs. To keep this project's torch and transformers, install it and the modules it
imports that the project's venv lacks into a folder of their own and put that on ``PYTHONPATH``:

    .venv/bin/python -m pip install --no-deps --target /tmp/spec-site speculators==0.9.0 hs-connectors==0.9.0 \
        loguru==0.7.3 pydantic-settings python-dotenv

Our feature store is converted once into speculators' offline layout
(``<workdir>/speculators-data``: a ``datasets`` folder with ``input_ids``, ``loss_mask``, ``seq_len``;
``hidden_states/hs_<i>.safetensors`` with ``hidden_states (T, 3+1, H)`` = the store's three fused target
layers and its last state, and ``token_ids (T,)``; ``d2t-<V>.npy``/``t2d-<V>.npy``, our draft vocabulary).
Its rows are our trainer's training rows (same held-out split, same seed) followed by our held-out
rows, which speculators' ``--train-data-ratio`` makes its validation split: both train on the same
samples, hidden states (same bytes) and draft vocabulary.

Each setting ``DTYPE:TTT`` (float32 or bfloat16 autocast; unrolled TTT steps) trains both, one at a
time, each in a fresh process with ``OMP_NUM_THREADS=--threads``, for ``--minutes`` of training time
(the sum of step times, data loading included: our ``train.max_minutes``; for speculators a step
callback stops the run), or with ``--epochs N`` for N passes over the training rows each (our
``data.epochs``, their ``--epochs``; no clock ends either run): the same training tokens, so that the
machine's speed decides the tokens/s but not what either head learnt. Both learning rates follow the
steps then (ours decays to 0.1 x the peak, theirs to 0); their step count differs from ours because
they pack rows into one ``--max-tokens`` row while we pad length-grouped rows up to it. Same AdamW
learning rate and warm-up, 2048 tokens per batch (our
``data.max_tokens``; their ``--total-seq-len``, one packed row), one draft layer, frozen lm_head
initialised from the target (their only choice; ``method.freeze_lm_head=true`` here), step-loss
decay 0.8. Reported per run:
- tokens/s: real (non-padding) sample tokens over the steps after the first ``--skip-steps``
  (steady state; the first steps carry start-up costs), and over all steps;
- peak RSS: the process's high-water mark (``ru_maxrss`` from ``wait4``, whole process life, start-up
  and final evaluation included); peak anon: the highest ``RssAnon`` sampled every 0.2 s, which leaves
  out file pages (our trainer memory-maps the feature store; theirs reads one file per sample);
- steps; held-out figures as each trainer reports them at its end, on the same held-out rows (ours: step-0
  top-1 agreement with the target's argmax over the whole vocabulary, every assistant token; theirs: loss
  and ``full_acc_0``, the argmax taken within the draft vocabulary: the two accuracies differ in definition);
- and per setting the ratios ours/theirs.
With ``--serve`` (the engine venv of ``scripts/setup_engine.sh``), every head is then served by vLLM's CPU build
through ``specheads serve-eval`` as its users would serve it (ours exported with ``specheads export engine=vllm``;
theirs, the folder its trainer wrote, given to the engine as it is), greedy chain of 3 on the prompts its
evaluation scored: the engine's own τ per domain beside the evaluator's for that chain, and whether the greedy
output equals plain decoding. With ``--evaluate``, every trained head (ours: the training folder; theirs: its last checkpoint, in
speculators' own format) is then decoded by ``specheads evaluate`` on the main job's prompt set
(``conf/pipeline.yaml``'s ``eval.*`` settings without its time budget, so both heads see every prompt,
``eval.chat_dir=--prepared``), greedy (T=0) with the lossless check, in the same shapes for every head:
the evaluator's dynamic tree (``head_shape=tree``, ``tree`` of conf/evaluate.yaml) and vLLM's chain of 3
(``serving.engines=[vllm]``); α and τ per domain and overall go in the report. speculators 0.9 trains EAGLE-3
by default with a sliding-window draft layer (window 2048) and three normalisations (``norm_before_residual``,
``norm_before_fc``, ``norm_output``); the evaluator computes all of them (our ``method.sliding_window`` and
``method.norm_*``, off in our defaults), so their default recipe is evaluated as it is. ``--their-arg=--no-norm-...``
and ``--their-arg=--full-attention-indices=0`` give their head the original EAGLE-3 architecture, ours, so that the
trainers differ only in how they train it.
``--method peagle``, ``--method dflash`` and ``--method dspark`` compare speculators' P-EAGLE, DFlash and DSpark
trainers with ours on the same store (both read EAGLE-3's three fused layers and the last state; each setting is
then ``DTYPE``, no TTT steps). Both trainers get one architecture, the one our evaluator decodes and vLLM serves:
one Llama-style full-attention layer and none of speculators' three normalisations for P-EAGLE (``--draft-arch llama
--full-attention-indices 0 --no-norm-before-residual --no-norm-before-fc --no-norm-output``), ``--num-depths``
tokens per forward, the draft vocabulary, a frozen LM head; one full-attention Qwen3-style layer for DFlash, blocks
of ``--block-size``, the target's whole vocabulary (our DFlash has no reduced one), D-PACE weights (their default;
``method.loss=dpace`` here), ``--anchors`` blocks per row for ours and as many per packed row of theirs (their
``--max-anchors``: ours times the rows a 2048-token batch holds on average). DSpark: DFlash's setting plus the
Markov head (rank 256) and the confidence head fed by it, trained on D-PACE's cross-entropy alone (theirs allows
D-PACE only with ``--loss-fn ce``, so neither trains the paper's L1 term; ``--dflash-decay-gamma 1e9`` makes their
confidence loss the plain mean ours is); vLLM's CPU build does not serve DSpark, so ``--serve`` records its refusal.
The masked slots read one token for both (our default mask-token rule, given to theirs as ``--mask-token-id``). Ours
starts from the target's highest fused layer and LM head rows as the main job does (P-EAGLE; DFlash: a random layer,
as the main job's); speculators starts its layers at random. Differences no flag removes: P-EAGLE's loss (theirs one
mean over every sampled depth, ours one mean per depth, summed), its anchors (theirs assistant positions only) and
``mask_hidden``'s starting scale; DFlash's and DSpark's anchor rule (theirs needs the anchor itself in the loss
mask, ours the token after it); DSpark's Markov input past the first drafted slot (theirs the data's tokens under
the target's labels, ours the target's tokens) and its starting Markov bias (theirs random, ours zero). speculators
0.9's P-EAGLE trains the token embedding whatever ``--embed-requires-grad`` says (its ``from_training_args`` drops
the flag), which would give a head whose embedding is no longer the target's: the child freezes it (patch 5 below),
as EAGLE-3's flag does. Their held-out figure is ``position_0_acc`` (P-EAGLE: depth 0) or ``position_1_acc``
(DFlash, DSpark: the first drafted slot), beside our ``step0_acc`` of the same slot.

Prints the exact command of every run, one JSON line per run and tables. ``--json`` writes a report that
``specheads record`` files under ``trainer_comparisons`` (peer speculators) in docs/benchmarks.json.

speculators 0.9 assumes an accelerator; its run here (``--theirs-child``, in this file) patches, at run
time and only in that process: the device the trainer moves the model and batches to (``cpu`` instead of
``get_local_rank()``, i.e. cuda:0), the autocast device type (``cpu`` instead of its ``cuda`` fallback),
``torch.accelerator.synchronize`` (a no-op without an accelerator; their step timer calls it), the
draft's ``verifier_norm`` (identity: our store holds the target's post-norm last state, vLLM's
pre-norm one) and, for P-EAGLE, the embedding's gradient (off). Documented flags pick CPU-capable paths:
``--draft-attn-impl sdpa`` (flex attention is compiled only on CUDA), ``--loss-implementation eager`` (the fused
loss is a Triton kernel),
``--num-workers 0`` (one process, like ours; the sampled memory is then the whole run's). When the time
budget ends their run, the child saves its checkpoint and runs their validation pass first, as their
trainer does at an epoch's end.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONVERT_FORMAT = "specheads.compare_speculators/1"
# the families both trainers train here (speculators' --speculator-type)
METHODS = ("eagle3", "peagle", "dflash", "dspark")


def common_arguments(description: str) -> argparse.ArgumentParser:
    """The options every ``compare_<peer>.py`` takes (the store, the evaluation, the shared training settings, the
    outputs); each script adds its peer's folder, settings, budget, batch and extra-flag options."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", help="our feature store (specheads collect, method=eagle3)")
    p.add_argument("--prepared", help="the prepared dataset the store was collected from")
    p.add_argument("--target", default="smollm2", help="target name or model folder (the store's target)")
    p.add_argument("--evaluate", action="store_true",
                   help="then decode every trained head with specheads evaluate (main job's prompts, T=0)")
    p.add_argument("--serve", action="store_true",
                   help="then serve every trained head in vLLM's CPU build (specheads serve-eval: ours exported to "
                        "vLLM's layout, theirs as its trainer wrote it; the prompts its evaluation scored, greedy "
                        "chain of 3; a head not yet evaluated is evaluated first)")
    p.add_argument("--eval-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra override for every specheads evaluate run")
    p.add_argument("--reuse", default=None, metavar="REPORT.json",
                   help="train nothing: evaluate the heads of an earlier --json report (its settings and runs); "
                        "with --serve alone, serve them beside the evaluations it recorded")
    p.add_argument("--skip-steps", type=int, default=5, help="first steps left out of the steady tokens/s")
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup-steps", type=int, default=10, help="learning-rate warm-up steps (both)")
    p.add_argument("--eval-samples", type=int, default=16, help="our held-out rows (data.eval_samples)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    p.add_argument("--only", choices=["ours", "theirs"], default=None, help="run one trainer only")
    p.add_argument("--our-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra Hydra override for our runs (after the matched ones)")
    p.add_argument("--workdir", default=None,
                   help="where the converted data and runs go (kept; reused when it matches the store)")
    p.add_argument("--json", default=None, help="also write the report to this file")
    return p


def checked_args(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    args = p.parse_args(argv)
    if not args.reuse and not (args.features and args.prepared):
        p.error("--features and --prepared are required (unless --reuse)")
    if hasattr(args, "method"):
        if args.settings is None:
            args.settings = ["float32:3", "bfloat16:3"] if args.method == "eagle3" else ["bfloat16"]
        for text in args.settings:
            if args.method != "eagle3" and parse_setting(text)[1] != 1:
                p.error(f"--settings {text}: {args.method} has no TTT steps; give the dtype alone")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = common_arguments(__doc__)
    p.add_argument("--method", choices=METHODS, default="eagle3", help="the drafter family both trainers train")
    p.add_argument("--settings", nargs="+", default=None, metavar="DTYPE:TTT",
                   help="float32|bfloat16 and TTT steps (EAGLE-3; DTYPE alone for the others), each trained by both "
                        "(default: float32:3 bfloat16:3; bfloat16 for P-EAGLE and DFlash)")
    p.add_argument("--num-depths", type=int, default=4, help="P-EAGLE: tokens one forward drafts (both)")
    p.add_argument("--block-size", type=int, default=8, help="DFlash: the block, the anchor and B-1 drafts (both)")
    p.add_argument("--anchors", type=int, default=32,
                   help="DFlash: blocks per row (ours); theirs gets as many per packed row of --max-tokens")
    p.add_argument("--minutes", type=float, default=2.5, help="training time per run (sum of step times)")
    p.add_argument("--epochs", type=int, default=None,
                   help="train N passes over the same training rows instead (equal tokens; --minutes unused)")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per batch (ours: padded; theirs: packed)")
    p.add_argument("--their-arg", action="append", default=[], metavar="FLAG",
                   help="an extra speculators flag (e.g. --their-arg=--num-workers=2)")
    return checked_args(p, argv)


def reused(args, peer: str = "speculators") -> tuple[argparse.Namespace, dict | None, list[dict]]:
    """(the earlier report's settings with this call's evaluation options, its store figures, its runs): a
    ``compare_<peer>.py --json`` report (compare_speculators.py's older ones have kind speculators_compare)."""
    old = json.loads(Path(args.reuse).read_text())
    if (old.get("kind"), old.get("peer", "speculators")) not in (("trainer_compare", peer),
                                                                  ("speculators_compare", peer)):
        raise SystemExit(f"--reuse {args.reuse}: not a compare_{peer}.py --json report")
    new = {k: getattr(args, k) for k in ("evaluate", "serve", "eval_arg", "json", "reuse")}
    evaluate = args.evaluate or not args.serve
    return (argparse.Namespace(**{**old["args"], "workdir": old["workdir"], **new, "evaluate": evaluate}),
            old.get("store"), old["runs"])


# --------------------------------------------------------------------------- data: our store -> speculators


def heldout_split(store, eval_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) row indices of ``store`` exactly as our train recipe splits them
    (``recipes/train.py: build_data``)."""
    from specheads.recipes.train import keep_chat_heldout_out
    from specheads.training.batches import split_rows

    n_eval = min(eval_samples, len(store) // 10)
    train_idx, eval_idx = split_rows(len(store), n_eval, seed)
    return keep_chat_heldout_out(store, train_idx, eval_idx)


def cached_conversion(features: str | Path, out: Path, fmt: str, draft_vocab_size: int, eval_samples: int,
                      seed: int) -> tuple:
    """(the store, the conversion's key, the earlier conversion in ``out`` when its ``convert.json`` matches the
    store and settings, else None after clearing ``out``): what each compare script's ``convert_store`` starts with."""
    from specheads.data.features import FeatureDataset

    store = FeatureDataset(features)
    key = {"format": fmt, "store": str(Path(features).resolve()), "plan_hash": store.manifest.get("plan_hash"),
           "draft_vocab_size": draft_vocab_size, "eval_samples": eval_samples, "seed": seed}
    done = Path(out) / "convert.json"
    if done.exists() and all(json.loads(done.read_text()).get(k) == v for k, v in key.items()):
        return store, key, json.loads(done.read_text())
    shutil.rmtree(out, ignore_errors=True)
    return store, key, None


def convert_store(features: str | Path, prepared: str | Path, out: str | Path, vocab_size: int,
                  draft_vocab_size: int, eval_samples: int = 16, seed: int = 0) -> dict:
    """Write our feature store as speculators' offline training data in ``out`` (see the module doc).

    Rows: our training rows, then our held-out rows; hidden states keep the store's dtype (float32 for
    an fp8 store). The draft vocabulary is ours (``build_draft_vocab`` over the training rows' loss
    tokens in ``prepared``). Returns what was written (also in ``out/convert.json``); an ``out`` whose
    convert.json matches the store and settings is reused as it is.
    """
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from specheads.data.store import STORE_DTYPES
    from specheads.models.vocab import build_draft_vocab, count_loss_tokens

    out = Path(out)
    store, key, earlier = cached_conversion(features, out, CONVERT_FORMAT, draft_vocab_size, eval_samples, seed)
    if earlier:
        return earlier
    done = out / "convert.json"
    train_idx, eval_idx = heldout_split(store, eval_samples, seed)
    order = list(train_idx) + list(eval_idx)
    dtype = STORE_DTYPES.get(store.manifest["dtype"], torch.float32)
    dtype = torch.float32 if dtype == torch.float8_e4m3fn else dtype
    H = store.hidden_size
    (out / "hidden_states").mkdir(parents=True)
    rows = {"id": [], "input_ids": [], "loss_mask": [], "seq_len": []}
    for file_idx, i in enumerate(order):
        item = store[i]
        T = item["input_ids"].numel()
        hidden = torch.cat([item["hidden_aux"].view(T, -1, H), item["hidden_last"].view(T, 1, H)], dim=1)
        save_file({"hidden_states": hidden.to(dtype).contiguous(), "token_ids": item["input_ids"].long()},
                  str(out / "hidden_states" / f"hs_{file_idx}.safetensors"))
        rows["id"].append(str(item["id"]))
        rows["input_ids"].append(item["input_ids"].tolist())
        rows["loss_mask"].append(item["loss_mask"].tolist())
        rows["seq_len"].append(T)
    data = Dataset.from_dict(rows)
    data.set_format("torch")
    data.save_to_disk(str(out / "dataset"))
    train_ids = rows["id"][: len(train_idx)]
    d2t, t2d = build_draft_vocab(count_loss_tokens(str(prepared), vocab_size, rows=train_ids), draft_vocab_size)
    np.save(out / "dataset" / f"d2t-{draft_vocab_size}.npy", d2t.numpy())
    np.save(out / "dataset" / f"t2d-{draft_vocab_size}.npy", t2d.numpy())
    info = {**key, "data_path": str(out / "dataset"), "hidden_states_path": str(out / "hidden_states"),
            "num_train": len(train_idx), "num_heldout": len(eval_idx),
            # speculators splits at int(n * ratio): this ratio puts exactly our held-out rows in its val split
            "train_data_ratio": (len(train_idx) + 0.5) / len(order),
            "train_tokens": int(sum(rows["seq_len"][: len(train_idx)])), "ids": rows["id"],
            "aux_layers": list(store.manifest["aux_layers"]), "hidden_dtype": str(dtype).removeprefix("torch.")}
    done.write_text(json.dumps(info))
    return info


# --------------------------------------------------------------------------- measuring a child process


def measure(cmd: list[str], env: dict, log_path: Path, interval: float = 0.2) -> dict:
    """Run ``cmd``; return exit code, wall seconds, peak RSS (ru_maxrss of this child, via wait4) and the
    highest RssAnon sampled from /proc every ``interval`` seconds (MiB)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        peak = {"anon": 0.0}
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                try:
                    with open(f"/proc/{proc.pid}/status") as f:
                        for line in f:
                            if line.startswith("RssAnon:"):
                                peak["anon"] = max(peak["anon"], int(line.split()[1]) / 1024)
                except OSError:
                    pass
                stop.wait(interval)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        stop.set()
        sampler.join()
    return {"rc": proc.returncode, "wall_s": time.perf_counter() - t0, "peak_rss_mib": usage.ru_maxrss / 1024,
            "peak_anon_mib": peak["anon"] or None}


def rates(steps: list[dict], skip: int) -> dict:
    """steps: per-step cumulative ``tokens`` and ``train_s`` -> totals, overall and steady tokens/s."""
    if not steps:
        return {"steps": 0, "tokens": 0, "train_s": 0.0, "tokens_per_s": None, "steady_tokens_per_s": None}
    last = steps[-1]
    out = {"steps": len(steps), "tokens": last["tokens"], "train_s": last["train_s"],
           "tokens_per_s": last["tokens"] / last["train_s"] if last["train_s"] else None,
           "steady_tokens_per_s": None}
    if len(steps) > skip + 1:
        base = steps[skip - 1] if skip else {"tokens": 0, "train_s": 0.0}
        out["steady_tokens_per_s"] = (last["tokens"] - base["tokens"]) / (last["train_s"] - base["train_s"])
    return out


# --------------------------------------------------------------------------- the two trainers


def parse_setting(text: str) -> tuple[str, int]:
    """``DTYPE:TTT`` -> (dtype, TTT steps); ``DTYPE`` alone is one step (the families without a TTT unroll)."""
    dtype, _, ttt = text.partition(":")
    ttt = ttt or "1"
    if dtype not in ("float32", "bfloat16") or not ttt.isdigit() or int(ttt) < 1:
        raise SystemExit(f"--settings {text!r}: expected float32:N or bfloat16:N with N >= 1")
    return dtype, int(ttt)


def method_of(args) -> str:
    """The family a run trains (the other compare_<peer>.py scripts and older reports: EAGLE-3)."""
    return getattr(args, "method", None) or "eagle3"


def setting_label(args, dtype: str, ttt: int) -> str:
    """A setting's name in the runs, the tables and the record: ``bfloat16:ttt3`` for EAGLE-3, the dtype alone
    for a family without TTT steps."""
    return f"{dtype}:ttt{ttt}" if method_of(args) == "eagle3" else dtype


def run_folder(args, trainer: str, dtype: str, ttt: int) -> str:
    return f"{trainer}-{setting_label(args, dtype, ttt).replace(':', '-')}"


def mask_token(target: str) -> int:
    """The token the masked slots read (P-EAGLE, DFlash): our default rule, given to both trainers."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer

    from specheads.models.dflash import default_mask_token
    from specheads.targets import resolve_target_path

    path = resolve_target_path(target)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    return default_mask_token(SimpleNamespace(vocab_size=vocab, tokenizer=AutoTokenizer.from_pretrained(path)))


def env_for(args) -> dict:
    threads = str(args.threads)
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def our_method_overrides(args, ttt: int) -> list[str]:
    """Our method's settings for the family compared (the module doc says what each matches)."""
    method = method_of(args)
    if method in ("dflash", "dspark"):
        block = [f"method={method}", "method.num_layers=1", f"method.block_size={args.block_size}", "method.loss=dpace",
                 "method.labels=target", f"method.anchors={args.anchors}", f"method.mask_token_id={args.mask_token}",
                 "method.init_layer_from_target=false"]
        if method == "dspark":  # D-PACE's CE alone (their dpace takes no L1 term), Markov rank and confidence head
            block += ["method.ce_weight=1.0", "method.l1_weight=0.0", "method.markov_rank=256",
                      "method.enable_confidence_head=true", "method.confidence_weight=1.0"]
        return block
    vocab = [f"method.draft_vocab_size={args.draft_vocab_size}", "method.init_layer_from_target=true",
             "method.init_lm_head_from_target=true", "method.freeze_lm_head=true"]
    if method == "peagle":
        return ["method=peagle", "method.num_layers=1", f"method.num_depths={args.num_depths}",
                f"method.mask_token_id={args.mask_token}", *vocab]
    return ["method=eagle3", f"method.ttt_steps={ttt}", *vocab]


def ours_command(args, dtype: str, ttt: int, out: Path) -> list[str]:
    exe = Path(sys.executable).with_name("specheads")
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "specheads.cli"]
    return head + [
        "train", f"target.name_or_path={args.target}", "target.dtype=float32", "target.device=cpu",
        f"output_dir={out}", f"prepared_dir={Path(args.prepared).resolve()}",
        f"features_dir={Path(args.features).resolve()}", f"seed={args.seed}",
        f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup_steps}", "train.max_steps=1000000",
        f"data.epochs={args.epochs}" if args.epochs else f"train.max_minutes={args.minutes}",
        f"train.mixed_precision={'bf16' if dtype == 'bfloat16' else 'no'}",
        "train.eval_every=0", "train.save_every=0", "train.measure_prompts=0", "train.progress=false",
        "train.resume=never", "wandb.mode=disabled", f"data.max_tokens={args.max_tokens}",
        f"data.eval_samples={args.eval_samples}", *our_method_overrides(args, ttt), *args.our_arg]


def run_ours(args, dtype: str, ttt: int, root: Path) -> dict:
    out = root / run_folder(args, "ours", dtype, ttt)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = ours_command(args, dtype, ttt, out)
    print(f"\n$ OMP_NUM_THREADS={args.threads} {shlex.join(cmd)}", flush=True)
    result = measure(cmd, env_for(args), out.parent / f"{out.name}.log")
    steps = []
    if (out / "metrics.jsonl").exists():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "train_s" in rec and "tokens" in rec:
                steps.append({"tokens": rec["tokens"], "train_s": rec["train_s"], "loss": rec.get("loss")})
    summary = json.loads((out / "train_summary.json").read_text()) if (out / "train_summary.json").exists() else {}
    ev = summary.get("eval") or {}
    return {**result, **rates(steps, args.skip_steps), "command": cmd, "log": str(out.parent / f"{out.name}.log"),
            "first_loss": steps[0]["loss"] if steps else None, "last_loss": steps[-1]["loss"] if steps else None,
            "heldout": {"top1_step0": ev.get("step0_acc")} if ev.get("step0_acc") is not None else None,
            "head_dir": str(out) if (out / "head").is_dir() else None,
            "self_reported": {k: summary.get(k) for k in ("steps", "tokens_per_s", "peak_rss_mb", "peak_anon_mb")}}


def their_method_flags(args, ttt: int, data: dict) -> list[str]:
    """speculators' flags for the family compared: the architecture ours trains (the module doc)."""
    method = method_of(args)
    vocab = ["--draft-vocab-size", str(args.draft_vocab_size)]
    if method in ("dflash", "dspark"):  # the whole vocabulary (no --draft-vocab-size), as ours
        per_row = args.max_tokens / max(data["train_tokens"] / max(data["num_train"], 1), 1)
        block = ["--block-size", str(args.block_size), "--full-attention-indices", "0",
                 "--mask-token-id", str(args.mask_token), "--no-sample-from-anchor", "--loss-fn", "ce",
                 "--per-position-loss-weight", "dpace", "--max-anchors", str(max(1, round(args.anchors * per_row)))]
        if method == "dspark":  # gamma drives only their confidence loss under dpace: 1e9 makes it a plain mean
            block += ["--dflash-decay-gamma", "1e9", "--markov-rank", "256", "--markov-head-type", "vanilla",
                      "--enable-confidence-head", "--confidence-head-with-markov", "--confidence-head-alpha", "1.0"]
        return block
    if method == "peagle":  # no cap on the anchors (ours: none), Llama's layer, none of the three norms
        return [*vocab, "--num-depths", str(args.num_depths), "--down-sample-ratio", "0.7",
                "--down-sample-ratio-min", "0.2", "--max-anchors", str(args.max_tokens), "--draft-arch", "llama",
                "--full-attention-indices", "0", "--no-norm-before-residual", "--no-norm-before-fc",
                "--no-norm-output", "--mask-token-id", str(args.mask_token)]
    return [*vocab, "--ttt-steps", str(ttt), "--ttt-step-loss-decay", "0.8"]


def theirs_flags(args, dtype: str, ttt: int, data: dict, out: Path) -> list[str]:
    from specheads.targets import resolve_target_path

    return [
        "--speculator-type", method_of(args), "--verifier-name-or-path", str(resolve_target_path(args.target)),
        "--data-path", data["data_path"], "--hidden-states-path", data["hidden_states_path"],
        "--target-layer-ids", *map(str, data["aux_layers"]), *their_method_flags(args, ttt, data),
        "--num-layers", "1", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        "--total-seq-len", str(args.max_tokens), "--hidden-states-dtype", dtype,
        "--train-data-ratio", repr(data["train_data_ratio"]), "--num-workers", "0", "--on-missing", "raise",
        "--optimizer", "adamw", "--lr", str(args.lr), "--weight-decay", "0", "--scheduler-type", "cosine",
        "--scheduler-warmup-steps", str(args.warmup_steps), "--epochs", str(args.epochs or 1000),
        "--seed", str(args.seed), "--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs"),
        *args.their_arg]


def run_theirs(args, dtype: str, ttt: int, root: Path, data: dict) -> dict:
    out = root / run_folder(args, "theirs", dtype, ttt)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    steps_path = out / "steps.jsonl"
    budget = 0 if args.epochs else args.minutes  # 0: no clock (their --epochs ends the run)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--theirs-child", str(steps_path), str(budget),
           "--", *theirs_flags(args, dtype, ttt, data, out)]
    print(f"\n$ PYTHONPATH={os.environ.get('PYTHONPATH', '')} OMP_NUM_THREADS={args.threads} {shlex.join(cmd)}",
          flush=True)
    result = measure(cmd, env_for(args), out.parent / f"{out.name}.log")
    steps = [json.loads(line) for line in steps_path.read_text().splitlines()] if steps_path.exists() else []
    val = json.loads((out / "val.json").read_text()) if (out / "val.json").exists() else None
    return {**result, **rates(steps, args.skip_steps), "command": cmd, "log": str(out.parent / f"{out.name}.log"),
            "first_loss": steps[0]["loss"] if steps else None, "last_loss": steps[-1]["loss"] if steps else None,
            "heldout": {"loss": val.get("loss_epoch"), "full_acc_step0": val.get(HELDOUT_KEY[method_of(args)])}
            if val else None,
            "head_dir": last_checkpoint(out / "checkpoints")}


def last_checkpoint(folder: Path) -> str | None:
    """speculators' newest epoch folder (``<save-path>/<epoch>``, config.json + model.safetensors), if any."""
    epochs = [d for d in folder.glob("*") if d.name.isdigit() and (d / "config.json").exists()] if folder.is_dir() else []
    return str(max(epochs, key=lambda d: int(d.name))) if epochs else None


# their validation figure of the first drafted token: EAGLE-3's step 0, P-EAGLE's depth 0, DFlash's slot 1
HELDOUT_KEY = {"eagle3": "full_acc_0_epoch", "peagle": "position_0_acc_epoch", "dflash": "position_1_acc_epoch",
               "dspark": "position_1_acc_epoch"}


class BudgetReached(Exception):
    """Raised from the step callback once the training-time budget is spent (ends speculators' run)."""


def theirs_child(steps_path: str, minutes: float, flags: list[str]) -> None:
    """Train with speculators' own CLI entry point (``speculators.train.cli.main``) in this process, with
    the CPU patches of the module doc; one JSON line per optimizer step to ``steps_path``, their validation
    metrics to ``val.json`` beside it. ``minutes`` 0: no time budget."""
    import torch
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer_mod
    from speculators.train.config import TrainConfig

    # Patch 1: speculators moves the model and every batch to get_local_rank() (0 = cuda:0).
    trainer_mod.get_local_rank = lambda: "cpu"
    # Patch 2: their step timer synchronizes the accelerator; without one that raises.
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None
    budget, log = 60 * minutes if minutes > 0 else float("inf"), open(steps_path, "w")
    val_path = Path(steps_path).with_name("val.json")
    kind = flags[flags.index("--speculator-type") + 1]

    class BenchTrainer(trainer_mod.Trainer):
        def __init__(self, model, config, train_loader, val_loader=None):
            # Patch 3: our store holds the target's post-norm last state (vLLM hands over the pre-norm
            # one, which the draft normalises with the target's norm before the verifier lm_head).
            model.verifier_norm = torch.nn.Identity()
            if kind == "peagle":  # Patch 5: PEagleDraftModel trains the target's embedding whatever the flag says
                model.embed_tokens.weight.requires_grad_(False)
            forward = model.forward

            def counted(**batch):  # real tokens: each packed sample lost its first token to shift_batch
                doc = batch["document_ids"]  # (but DFlash's batches are not shifted)
                self._tokens = int((doc >= 0).sum()) + (0 if kind in ("dflash", "dspark") else int(doc.max()) + 1)
                out = forward(**batch)
                self._loss = float(out[1].detach())
                return out

            model.forward = counted
            self._total_s, self._total_tokens, self._steps = 0.0, 0, 0
            super().__init__(model, config, train_loader, val_loader)
            self.device_type = "cpu"  # Patch 4: autocast on the CPU (speculators falls back to "cuda")

        def train_epoch(self, epoch, *, step_callback=None):
            self._last, self._epoch = time.perf_counter(), epoch
            return super().train_epoch(epoch, step_callback=self._on_step)

        def val_epoch(self, epoch):
            metrics = super().val_epoch(epoch)
            if metrics is not None:
                val_path.write_text(json.dumps({**metrics, "epoch": epoch, "step": self._steps}))
            return metrics

        def _on_step(self):
            now = time.perf_counter()
            self._total_s += now - self._last
            self._last = now
            self._total_tokens += self._tokens
            self._steps += 1
            log.write(json.dumps({"step": self._steps, "tokens": self._total_tokens, "train_s": self._total_s,
                                  "loss": self._loss}) + "\n")
            log.flush()
            if self._total_s >= budget:  # end as their epoch end does: a checkpoint, then validation
                self.maybe_save_checkpoint(self._epoch)
                self.val_epoch(self._epoch)
                raise BudgetReached

    cli.Trainer = BenchTrainer
    try:
        cli.main(TrainConfig.resolve(flags))
    except BudgetReached:
        print(f"time budget of {minutes} min reached", flush=True)
    finally:
        log.close()


# --------------------------------------------------------------------------- acceptance: our evaluator on both heads

# the same shapes for every head: the evaluator's dynamic tree and vLLM's chain of 3; greedy, batch 1, no baselines;
# the target's precision pinned (left to the evaluator, a timed probe picks it by the machine's speed at that moment)
EVAL_FIXED = ["target.dtype=float32", "baselines=[]", "head_shape=tree", "head_ngram=0", "temperatures=[0.0]", "batch_sizes=[1]",
              "serving.engines=[vllm]", "eval.max_minutes=null"]



def main_job_prompts() -> list[str]:
    """The main job's evaluation prompt set: the ``eval.*`` items of ``conf/pipeline.yaml``'s evaluate stage,
    less its time budget (a budget could leave out different prompts for each head)."""
    from omegaconf import OmegaConf

    stage = OmegaConf.load(REPO / "conf" / "pipeline.yaml").stages.evaluate
    return [str(o) for o in stage if str(o).startswith("eval.") and not str(o).startswith("eval.max_minutes")]


def eval_command(args, head_dir: str, out: Path) -> list[str]:
    return specheads_command() + ["evaluate", f"target.name_or_path={args.target}", f"head_dir={head_dir}",
                   f"eval.chat_dir={Path(args.prepared).resolve()}", f"output_dir={out}", f"seed={args.seed}",
                   *main_job_prompts(), *EVAL_FIXED, *args.eval_arg]


def acceptance(report: dict) -> dict:
    """From an evaluator report.json: prompts, lossless verdict and, per method row, shape, α and τ overall
    (``all``) and per domain at the first temperature."""
    rows = []
    for m in report.get("methods", []):
        by = m.get("by_temperature") or {}
        if not by:
            continue
        doms = next(iter(by.values()))
        rows.append({"name": m["name"], "shape": m.get("shape"),
                     "lossless": (m.get("lossless") or {}).get("exact"),
                     "domains": {d: {"alpha": r.get("alpha"), "tau": r.get("tau"), "prompts": r.get("prompts")}
                                 for d, r in doms.items()}})
    return {"prompts": report.get("num_prompts"), "max_new_tokens": report.get("max_new_tokens"),
            "target_dtype": str(report.get("target_dtype", "")).removeprefix("torch.") or None, "methods": rows}


def run_eval(args, run: dict, root: Path) -> dict | None:
    """``specheads evaluate`` on one trained head; its ``acceptance`` figures, or None (the log says why)."""
    if not run.get("head_dir"):
        print(f"{run['trainer']} {run['setting']}: no trained head to evaluate", file=sys.stderr)
        return None
    out = root / f"eval-{run['trainer']}-{run['setting'].replace(':', '-')}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = eval_command(args, run["head_dir"], out)
    print(f"\n$ OMP_NUM_THREADS={args.threads} {shlex.join(cmd)}", flush=True)
    result = measure(cmd, env_for(args), root / f"{out.name}.log")
    report = out / "report.json"
    if result["rc"] != 0 or not report.exists():
        print(f"evaluate {run['trainer']} {run['setting']}: failed (exit {result['rc']}); log {out.name}.log:\n"
              + "".join((root / f"{out.name}.log").read_text().splitlines(keepends=True)[-20:]), file=sys.stderr)
        return None
    return {**acceptance(json.loads(report.read_text())), "wall_s": result["wall_s"], "command": cmd}


# --------------------------------------------------------------------------- serving: the real engine on both heads

SERVE_TOKENS = 3  # vLLM's chain, as the evaluation's vLLM profile row drafts it


def specheads_command() -> list[str]:
    """The ``specheads`` command beside this python (``python -m specheads.cli`` where it is not installed)."""
    exe = Path(sys.executable).with_name("specheads")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "specheads.cli"]


def serve_command(args, export_dir: str, eval_report: Path, out: Path) -> list[str]:
    return specheads_command() + [
        "serve-eval", f"target.name_or_path={args.target}", f"export_dir={export_dir}",
        f"eval.chat_dir={Path(args.prepared).resolve()}", f"output_dir={out}", f"num_speculative_tokens={SERVE_TOKENS}",
        *main_job_prompts(), *([f"eval_report={eval_report}"] if eval_report.is_file() else [])]


def served(report: dict) -> dict:
    """From a serve_report.json: the engine's figures per domain (τ, acceptance per position, greedy identity with
    plain decoding, tokens/s speed-up) and the evaluator's τ for the same chain where it measured one."""
    every = report.get("domains", {})
    ev = (report.get("evaluator") or {}).get("domains") or {}
    return {"prompts": report.get("num_prompts"), "engine": (report.get("engine") or {}).get("version"),
            "head_source": report.get("head_source"), "refused": report.get("refused"),
            "domains": {d: {"tau": f["spec"].get("tau"), "reach": f["spec"].get("reach"),
                            "identical": f.get("identical"), "compared": f.get("compared"),
                            "speedup": f.get("speedup"), "tau_evaluator": (ev.get(d) or {}).get("tau_evaluator")}
                        for d, f in every.items()}}


def run_serve(args, run: dict, root: Path) -> dict | None:
    """``specheads serve-eval`` on one trained head (ours first exported with ``specheads export engine=vllm``;
    theirs, the folder its trainer wrote, given to the engine as its users give it): ``served`` figures, or None
    (the log says why)."""
    if not run.get("head_dir"):
        return None
    name = f"{run['trainer']}-{run['setting'].replace(':', '-')}"
    export_dir = run["head_dir"]
    if run["trainer"] == "ours":
        out = root / f"export-{name}"
        cmd = specheads_command() + ["export", f"target.name_or_path={args.target}", f"head_dir={run['head_dir']}",
                                     f"output_dir={out}", "engine=vllm", "eval_report=null", "overwrite=true"]
        print(f"\n$ {shlex.join(cmd)}", flush=True)
        if measure(cmd, env_for(args), root / f"export-{name}.log")["rc"] != 0:
            print(f"export {name}: failed; log export-{name}.log", file=sys.stderr)
            return None
        export_dir = str(out)
    out = root / f"serve-{name}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = serve_command(args, export_dir, root / f"eval-{name}" / "report.json", out)
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    result = measure(cmd, env_for(args), root / f"serve-{name}.log")
    path = out / "serve_report.json"
    if not path.is_file():
        print(f"serve {name}: failed (exit {result['rc']}); log serve-{name}.log:\n"
              + "".join((root / f"serve-{name}.log").read_text().splitlines(keepends=True)[-20:]), file=sys.stderr)
        return None
    return {**served(json.loads(path.read_text())), "wall_s": result["wall_s"], "command": cmd}


# --------------------------------------------------------------------------- report


def speculators_missing() -> str | None:
    """None when speculators' trainer imports here, else why not."""
    if importlib.util.find_spec("speculators") is None:
        return "the speculators package is not installed"
    try:
        import speculators.train.cli  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: skip
        return f"speculators.train.cli does not import ({type(e).__name__}: {e})"
    return None


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def fmt(value, spec: str) -> str:
    return format(value, spec) if value is not None else format("-", ">" + spec.split(".")[0])


def print_table(results: list[dict]) -> None:
    print(f"\n{'setting':<13} {'trainer':<8} {'steps':>6} {'tokens':>9} {'steady tok/s':>12} {'all tok/s':>10} "
          f"{'peak RSS MiB':>12} {'peak anon MiB':>13}")
    for r in results:
        print(f"{r['setting']:<13} {r['trainer']:<8} {r['steps']:>6} {r['tokens']:>9} "
              f"{fmt(r['steady_tokens_per_s'], '12.0f')} {fmt(r['tokens_per_s'], '10.0f')} "
              f"{fmt(r['peak_rss_mib'], '12.0f')} {fmt(r['peak_anon_mib'], '13.0f')}")
    by = {(r["setting"], r["trainer"]): r for r in results}
    settings = list(dict.fromkeys(r["setting"] for r in results))
    pairs = [(s, by[s, "ours"], by[s, "theirs"]) for s in settings if (s, "ours") in by and (s, "theirs") in by]
    if pairs:
        print(f"\n{'ours/theirs':<13} {'steady tok/s':>12} {'all tok/s':>10} {'peak RSS':>9} {'peak anon':>10}")
        for s, o, t in pairs:
            print(f"{s:<13} {ratio(o['steady_tokens_per_s'], t['steady_tokens_per_s']):>12} "
                  f"{ratio(o['tokens_per_s'], t['tokens_per_s']):>10} {ratio(o['peak_rss_mib'], t['peak_rss_mib']):>9} "
                  f"{ratio(o['peak_anon_mib'], t['peak_anon_mib']):>10}")
    if any(r.get("heldout") for r in results):
        print(f"\n{'setting':<13} {'trainer':<8} {'held-out loss':>13} {'step-0 top-1':>12}  "
              "(each trainer's own definition: the script's docstring)")
        for r in results:
            h = r.get("heldout") or {}
            print(f"{r['setting']:<13} {r['trainer']:<8} {fmt(h.get('loss'), '13.4f')} "
                  f"{fmt(h.get('top1_step0', h.get('full_acc_step0')), '12.4f')}")
    print_acceptance(results)
    print_served(results)


def print_acceptance(results: list[dict]) -> None:
    """α and τ per domain of every evaluated head, one column pair per (setting, trainer), per evaluator row (a
    shape: DSpark's two rows share one)."""
    evaluated = [r for r in results if r.get("eval")]
    if not evaluated:
        return
    names = list(dict.fromkeys(m["name"] for r in evaluated for m in r["eval"]["methods"]))
    for name in names:
        cols = [(r, next((m for m in r["eval"]["methods"] if m["name"] == name), None)) for r in evaluated]
        cols = [(r, m) for r, m in cols if m]
        domains = list(dict.fromkeys(d for _, m in cols for d in m["domains"]))
        print(f"\nacceptance at T=0, {name} ({cols[0][1]['shape']}): α / τ" + "".join(
            f"; {r['trainer']} {r['setting']} lossless {m['lossless']}" for r, m in cols))
        print(f"{'domain':<12}" + "".join(f" {r['trainer'] + ' ' + r['setting']:>24}" for r, _ in cols))
        for d in domains:
            cells = [m["domains"].get(d) or {} for _, m in cols]
            print(f"{d:<12}" + "".join(f" {fmt(c.get('alpha'), '11.2f')} {fmt(c.get('tau'), '12.2f')}" for c in cells))


def print_served(results: list[dict]) -> None:
    """The engine's τ per domain of every served head (vLLM's chain), greedy identity with plain decoding."""
    done = [r for r in results if r.get("serve")]
    if not done:
        return
    domains = list(dict.fromkeys(d for r in done for d in r["serve"]["domains"]))
    print(f"\nserved by vLLM {done[0]['serve']['engine']}, chain of {SERVE_TOKENS}: τ (engine) / τ (evaluator)"
          + "".join(f"; {r['trainer']} {r['setting']} identical {(r['serve']['domains'].get('all') or {}).get('identical')}"
                    f" of {(r['serve']['domains'].get('all') or {}).get('compared')}" for r in done))
    print(f"{'domain':<12}" + "".join(f" {r['trainer'] + ' ' + r['setting']:>24}" for r in done))
    for d in domains:
        cells = [r["serve"]["domains"].get(d) or {} for r in done]
        print(f"{d:<12}" + "".join(f" {fmt(c.get('tau'), '11.2f')} {fmt(c.get('tau_evaluator'), '12.2f')}" for c in cells))


def report(args, root: Path, data: dict | None, results: list[dict]) -> dict:
    """What ``--json`` writes (``specheads record`` reads it: ``kind`` speculators_compare)."""
    from specheads.hardware import cpu_description

    versions = {}
    for name in ("torch", "transformers", "speculators"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    store = {k: data[k] for k in ("num_train", "num_heldout", "train_tokens", "hidden_dtype", "plan_hash")} if data else None
    return {"kind": "speculators_compare", "method": method_of(args), "machine": cpu_description(),
            "target": args.target, "versions": versions,
            "budget": {"epochs": args.epochs} if args.epochs else {"minutes": args.minutes},
            "settings": {"draft_vocab_size": args.draft_vocab_size, "max_tokens": args.max_tokens, "lr": args.lr,
                         "warmup_steps": args.warmup_steps, "eval_samples": args.eval_samples, "seed": args.seed,
                         "threads": args.threads, "skip_steps": args.skip_steps, "our_args": args.our_arg,
                         "their_args": args.their_arg, **method_settings(args)},
            "evaluation": {"prompts": main_job_prompts(), "fixed": EVAL_FIXED, "extra": args.eval_arg}
            if args.evaluate or any(r.get("eval") for r in results) else None,
            "serving": {"engine": "vLLM CPU build (specheads serve-eval)", "num_speculative_tokens": SERVE_TOKENS,
                        "prompts": "those the evaluation scored", "greedy": True}
            if any(r.get("serve") for r in results) else None,
            "store": store, "args": vars(args), "workdir": str(root), "runs": results}


def method_settings(args) -> dict:
    """The family's own matched settings, for the report (none for EAGLE-3: its TTT steps are in each setting)."""
    method = method_of(args)
    if method == "peagle":
        return {"num_depths": args.num_depths, "mask_token_id": args.mask_token}
    if method in ("dflash", "dspark"):
        return {"block_size": args.block_size, "anchors": args.anchors, "mask_token_id": args.mask_token}
    return {}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--theirs-child"]:  # internal: one speculators run in this process
        steps_path, minutes, sep, *flags = argv[1:]
        if sep != "--":
            raise SystemExit("usage: --theirs-child STEPS.jsonl MINUTES -- <speculators train flags>")
        theirs_child(steps_path, float(minutes), flags)
        return
    args = parse_args(argv)
    if args.reuse:
        args, data, results = reused(args)
        return finish(args, Path(args.workdir), data, results)
    settings = [parse_setting(s) for s in args.settings]
    trainers = [args.only] if args.only else ["ours", "theirs"]
    if "theirs" in trainers and (why := speculators_missing()):
        print(f"SKIP speculators: {why}; install speculators (v0.9) or put it on PYTHONPATH to compare "
              f"against it", file=sys.stderr)
        trainers.remove("theirs")
        if not trainers:
            return
    root = Path(args.workdir or tempfile.mkdtemp(prefix="compare-speculators-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    args.mask_token = mask_token(args.target) if args.method != "eagle3" else None
    data = None
    if "theirs" in trainers:
        from transformers import AutoConfig

        from specheads.targets import resolve_target_path

        vocab = AutoConfig.from_pretrained(resolve_target_path(args.target)).vocab_size
        t0 = time.perf_counter()
        data = convert_store(args.features, args.prepared, root / "speculators-data", vocab,
                             args.draft_vocab_size, args.eval_samples, args.seed)
        print(f"speculators data: {data['num_train']} training rows ({data['train_tokens']} tokens) + "
              f"{data['num_heldout']} held out, {data['hidden_dtype']} hidden states, in {data['data_path']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    results = train_both(args, settings, trainers, root, data,
                         lambda dtype, ttt: run_theirs(args, dtype, ttt, root, data))
    finish(args, root, data, results)


def train_both(args, settings, trainers: list[str], root: Path, data: dict | None, run_theirs) -> list[dict]:
    """Each setting's runs, one trainer at a time (ours: ``run_ours``; theirs: ``run_theirs(dtype, ttt)``), each
    printed as it ends (a failed one with its log's end)."""
    results = []
    for dtype, ttt in settings:
        for trainer in trainers:
            r = run_ours(args, dtype, ttt, root) if trainer == "ours" else run_theirs(dtype, ttt)
            r = {"setting": setting_label(args, dtype, ttt), "trainer": trainer, **r}
            if r["rc"] != 0 or not r["steps"]:
                print(f"{trainer} {r['setting']}: failed (exit {r['rc']}); log {r['log']}:\n"
                      + "".join(Path(r["log"]).read_text().splitlines(keepends=True)[-30:]), file=sys.stderr)
            print(json.dumps({k: v for k, v in r.items() if k != "command"}), flush=True)
            if args.epochs and data:  # equal tokens: each run saw every training token once per epoch
                print(f"{trainer} {r['setting']}: {r['tokens']} tokens trained, {args.epochs} x "
                      f"{data['train_tokens']} in the training rows", flush=True)
            results.append(r)
    return results


def finish(args, root: Path, data: dict | None, results: list[dict], make_report=None) -> None:
    """Evaluate the trained heads (``--evaluate``), print the tables, write ``--json`` (``make_report``: the
    peer's report, this file's by default)."""
    serve = getattr(args, "serve", False)
    for r in results:
        if args.evaluate or (serve and not r.get("eval")):
            r["eval"] = run_eval(args, r, root)
    if serve:
        for r in results:
            r["serve"] = run_serve(args, r, root)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps((make_report or report)(args, root, data, results), indent=1))


if __name__ == "__main__":
    main()
