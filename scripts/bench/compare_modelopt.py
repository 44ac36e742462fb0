"""Benchmark our EAGLE-3 trainer against NVIDIA ModelOpt's on the same target, rows and settings (run by hand).

    PYTHONPATH= python scripts/bench/compare_modelopt.py --modelopt-site /tmp/modelopt-site \
        --features runs/quickstart/features --prepared runs/quickstart/prepared --epochs 1 --evaluate --json mo.json
    ... --settings float32:1 bfloat16:3       # dtype (float32, or bfloat16 autocast) and TTT steps, both trainers
    ... --only ours                           # our trainer alone (ModelOpt need not be installed)
    python scripts/bench/compare_modelopt.py --reuse mo.json --json mo-eval.json   # evaluate those heads again
    python scripts/bench/compare_modelopt.py --reuse mo.json --serve --json mo-served.json  # serve both in vLLM

ModelOpt (nvidia-modelopt 0.47, with ``pulp`` and ``scipy`` that ``modelopt.torch`` imports) is not a dependency of
this project: install it into a folder of its own (``pip install --no-deps --target DIR nvidia-modelopt pulp scipy``)
and give it as ``--modelopt-site``; its runs go in a fresh process with that folder on ``PYTHONPATH``
(``--modelopt-child``, in this file). ModelOpt 0.47 supports transformers < 5.13; on a newer one the child patches two
renames at run time, in that process only: the decoder layer's ``past_key_values`` argument (now ``cache``; without it
the training-time-test KV cache would be lost) and ``LlamaRotaryEmbedding``'s dropped ``device`` argument.

Data: our feature store is converted once into ModelOpt's offline format (``<workdir>/modelopt-data``): one ``.pt``
per row with ``input_ids``, ``hidden_states`` (the store's post-norm last state, as ModelOpt's own dump takes
``hidden_states[-1]``), ``aux_hidden_states`` (the store's fused layers; ModelOpt's ids are decoder-layer outputs, so
ours minus one) and ``loss_mask``, in ``train/`` (our trainer's training rows: same held-out split, same seed) and
``heldout/`` (our held-out rows); ``d2t.pt``, our draft vocabulary (``build_draft_vocab`` over the training rows' loss
tokens) in the offset form ModelOpt loads. Hidden states keep the store's dtype on disk and are read as float32.
The loss mask is ours shifted left by one: ModelOpt weighs the prediction made at position p with ``loss_mask[p]``
(the token p + 1 it predicts), ours the prediction of token j with ``loss_mask[j]``; shifted, both count exactly the
answer tokens (``answer_only_loss``).

Each setting ``DTYPE:TTT`` trains both, one at a time, each in a fresh process with ``OMP_NUM_THREADS=--threads``,
for ``--epochs`` passes over the training rows (the same tokens). Matched: one draft layer of the target's shape
(heads, kv heads, head size, MLP width, norm eps: ModelOpt's default layer is sized for an 8B target), the target's
rope_theta without scaling (and no rope scaling added at export: ``eagle_export_rope_scaling={}``), the aux layers,
AdamW (weight decay 0) at ``--lr`` with ``--warmup-steps`` of linear warm-up, TTT steps, step-loss decay 0.8
(ModelOpt's ``eagle_loss_decay_factor``, our default), the draft vocabulary, answer-only loss, the draft layer and
LM head randomly initialised and trained (ModelOpt cannot start them from the target's weights: ours is told
``method.init_layer_from_target=false method.init_lm_head_from_target=false method.freeze_lm_head=false``), no
torch.compile (ModelOpt's ``eagle_use_torch_compile``: on a CPU its max-autotune takes minutes per TTT length).
Differences left: the learning-rate decay (ModelOpt: HF Trainer's cosine to 0; ours to 0.1 x the peak), batches
(ModelOpt: ``max_tokens // L`` rows per step, each padded to L, the longest row; ours: length-grouped rows padded up to
``--max-tokens``), gradient clipping (HF Trainer's max-norm 1.0; ours: our default), the loss (ModelOpt: forward KL
to the target's distribution renormalised over the draft vocabulary, every step; ours: our EAGLE-3 loss), the
initialisations' random draws, and ModelOpt's first draft layer, which norms the fed hidden state with
``input_layernorm`` before ``hidden_norm`` (the head option ``hidden_after_input_norm``: evaluated as it trains).
Reported per run as compare_speculators.py reports: tokens/s (steady and overall: real tokens over the summed step
times, data loading included), peak RSS / anon, steps, losses, held-out figures as each trainer defines them (ours:
step-0 top-1 over the whole vocabulary; ModelOpt: loss and step-0 top-1 within the draft vocabulary, its
``train_acc``, weighted by the rows' counted tokens). ``--evaluate`` then decodes both heads with ``specheads
evaluate`` (ours: the training folder; ModelOpt's: its ``export_speculative_decoding`` folder, read by
``specheads.export.foreign``) on the main job's prompts, greedy, lossless-checked, in the same shapes
(compare_speculators.py's ``eval_command``). ``--json`` writes the report that ``specheads record`` files under
``trainer_comparisons`` (``kind: trainer_compare``, ``peer: modelopt``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_speculators as cs  # noqa: E402  (the shared store split, measuring, evaluation and tables)

REPO = cs.REPO
CONVERT_FORMAT = "specheads.compare_modelopt/1"
MATCH_OURS = ["method.init_layer_from_target=false", "method.init_lm_head_from_target=false",
              "method.freeze_lm_head=false"]  # ModelOpt's draft layer and LM head start random and train
LOSS_DECAY = 0.8


def parse_args(argv=None) -> argparse.Namespace:
    p = cs.common_arguments(__doc__)
    p.add_argument("--modelopt-site", default=None, help="the folder holding ModelOpt (put on the child's PYTHONPATH)")
    p.add_argument("--settings", nargs="+", default=["float32:1"], metavar="DTYPE:TTT",
                   help="float32|bfloat16 and TTT steps, each trained by both (default: float32:1)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training rows (both trainers)")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per batch (ours: padded; ModelOpt: rows x L)")
    args = cs.checked_args(p, argv)
    args.our_arg = MATCH_OURS + args.our_arg
    args.minutes, args.their_arg = None, []  # what compare_speculators' shared functions read
    return args


# --------------------------------------------------------------------------- data: our store -> ModelOpt's offline rows


def modelopt_loss_mask(loss_mask):
    """(T,) our mask (token j counted at j) -> ModelOpt's (the prediction made at p, of token p + 1, counted at p)."""
    import torch

    out = torch.zeros_like(loss_mask, dtype=torch.long)
    out[:-1] = loss_mask[1:].long()
    return out


def convert_store(features: str | Path, prepared: str | Path, out: str | Path, vocab_size: int,
                  draft_vocab_size: int, eval_samples: int = 16, seed: int = 0) -> dict:
    """Write our feature store as ModelOpt's offline rows in ``out`` (see the module doc); returns what was written
    (also ``out/convert.json``; an ``out`` whose convert.json matches the store and settings is reused)."""
    import torch

    from specheads.data.store import STORE_DTYPES
    from specheads.models.vocab import build_draft_vocab, count_loss_tokens

    out = Path(out)
    store, key, earlier = cs.cached_conversion(features, out, CONVERT_FORMAT, draft_vocab_size, eval_samples, seed)
    if earlier:
        return earlier
    done = out / "convert.json"
    train_idx, eval_idx = cs.heldout_split(store, eval_samples, seed)
    dtype = STORE_DTYPES.get(store.manifest["dtype"], torch.float32)
    dtype = torch.float32 if dtype == torch.float8_e4m3fn else dtype
    ids, lengths = {}, []
    for split, rows in (("train", train_idx), ("heldout", eval_idx)):
        (out / split).mkdir(parents=True)
        ids[split] = []
        for k, i in enumerate(rows):
            item = store[i]
            torch.save({"input_ids": item["input_ids"].long(), "hidden_states": item["hidden_last"].to(dtype),
                        "aux_hidden_states": item["hidden_aux"].to(dtype),
                        "loss_mask": modelopt_loss_mask(item["loss_mask"])}, out / split / f"{k:06d}.pt")
            ids[split].append(str(item["id"]))
            lengths.append(item["input_ids"].numel())
    d2t, _ = build_draft_vocab(count_loss_tokens(str(prepared), vocab_size, rows=ids["train"]), draft_vocab_size)
    torch.save(d2t.long(), out / "d2t.pt")
    info = {**key, "train_dir": str(out / "train"), "heldout_dir": str(out / "heldout"), "d2t": str(out / "d2t.pt"),
            "num_train": len(train_idx), "num_heldout": len(eval_idx), "ids": ids["train"] + ids["heldout"],
            "train_tokens": int(sum(lengths[: len(train_idx)])), "max_length": max(lengths),
            "aux_layers": list(store.manifest["aux_layers"]), "hidden_dtype": str(dtype).removeprefix("torch.")}
    done.write_text(json.dumps(info))
    return info


# --------------------------------------------------------------------------- ModelOpt's run (a child process)


def modelopt_flags(args, dtype: str, ttt: int, data: dict, out: Path) -> dict:
    """The child's settings (one JSON argument)."""
    from specheads.targets import resolve_target_path

    rows = max(1, args.max_tokens // data["max_length"])
    return {"target": str(resolve_target_path(args.target)), "train_dir": data["train_dir"],
            "heldout_dir": data["heldout_dir"], "d2t": data["d2t"], "out": str(out), "dtype": dtype, "ttt": ttt,
            "aux_ids": [i - 1 for i in data["aux_layers"]], "draft_vocab_size": args.draft_vocab_size,
            "train_len": data["max_length"], "batch_rows": rows, "epochs": args.epochs, "lr": args.lr,
            "warmup_steps": args.warmup_steps, "seed": args.seed}


def _shim_transformers() -> None:
    """ModelOpt 0.47 on transformers >= 5.13: the renames named in the module doc, patched in this process."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.13"):
        return
    import modelopt.torch.speculative.plugins.hf_eagle as hf_eagle
    import modelopt.torch.speculative.plugins.modeling_eagle as modeling_eagle
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    class RenamedCacheLayer(LlamaDecoderLayer):
        def forward(self, *args, past_key_values=None, **kwargs):
            return super().forward(*args, cache=past_key_values, **kwargs)

    def rope_without_device(self, device=None):
        if self.config.eagle_decoder_type == "llama" and not hasattr(self, "rotary_emb"):
            self.rotary_emb = LlamaRotaryEmbedding(config=self.config).to(device)

    hf_eagle.LlamaDecoderLayer = RenamedCacheLayer
    modeling_eagle.EagleModule._maybe_init_rope = rope_without_device


def modelopt_child(flags: dict) -> None:
    """Convert the target to ModelOpt's EAGLE-3 (offline), train it with HF Trainer, report steps to
    ``out/steps.jsonl`` and held-out figures to ``out/val.json``, export to ``out/export``."""
    import torch
    import transformers

    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.config import eagle3_default_config
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.utils import load_vlm_or_llm

    _shim_transformers()
    transformers.set_seed(flags["seed"])
    out = Path(flags["out"])
    tc = transformers.AutoConfig.from_pretrained(flags["target"])
    model = load_vlm_or_llm(flags["target"], use_offline_training=True, dtype=torch.float32, device_map="cpu")
    theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta") or getattr(tc, "rope_theta", 10000.0)
    arch = {**eagle3_default_config, "num_hidden_layers": 1, "hidden_act": tc.hidden_act,
            "num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads,
            "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            "intermediate_size": tc.intermediate_size, "rms_norm_eps": tc.rms_norm_eps, "rope_theta": theta,
            "rope_scaling": {"rope_type": "default", "rope_theta": theta},
            "draft_vocab_size": flags["draft_vocab_size"], "eagle_aux_hidden_state_layer_ids": flags["aux_ids"]}
    mtsp.convert(model, [("eagle", {"eagle_offline": True, "eagle_decoder_type": "llama", "eagle_ttt_steps":
                                    flags["ttt"], "eagle_use_torch_compile": False, "eagle_loss_decay_factor":
                                    LOSS_DECAY, "eagle_export_rope_scaling": {}, "eagle_architecture_config": arch})])
    mtsp.plugins.HFEagleModel.load_draft_vocab_cache(model, flags["d2t"])

    class Rows(OfflineSupervisedDataset):  # the store's dtype on disk, float32 in the model
        def __getitem__(self, i):
            return {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v)
                    for k, v in super().__getitem__(i).items()}

    def rows(folder):
        return Rows(sorted(str(f) for f in Path(folder).glob("*.pt")), answer_only_loss=True)

    steps_log = open(out / "steps.jsonl", "w")

    class Timed(transformers.Trainer):
        tokens, train_s, last, loss = 0, 0.0, None, None

        def training_step(self, model, inputs, *a, **k):
            self.tokens += int(inputs["attention_mask"].sum())
            loss = super().training_step(model, inputs, *a, **k)
            self.loss = float(loss.detach())
            return loss

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            trainer.last = trainer.last or time.perf_counter()

        def on_step_end(self, targs, state, control, **kw):
            now = time.perf_counter()
            trainer.train_s += now - trainer.last
            trainer.last = now
            steps_log.write(json.dumps({"step": state.global_step, "tokens": trainer.tokens,
                                        "train_s": trainer.train_s, "loss": trainer.loss}) + "\n")
            steps_log.flush()

    targs = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), num_train_epochs=flags["epochs"], per_device_train_batch_size=flags[
            "batch_rows"], learning_rate=flags["lr"], warmup_steps=flags["warmup_steps"], lr_scheduler_type="cosine",
        weight_decay=0.0, bf16=flags["dtype"] == "bfloat16", use_cpu=True, save_strategy="no", report_to=[],
        logging_steps=10, remove_unused_columns=False, disable_tqdm=True, seed=flags["seed"], dataloader_num_workers=0)
    collate = EagleOfflineDataCollator(train_len=flags["train_len"])
    trainer = Timed(model=model, args=targs, train_dataset=rows(flags["train_dir"]), data_collator=collate,
                    callbacks=[StepTimes()])
    trainer.train()
    steps_log.close()
    model.eval()
    (out / "val.json").write_text(json.dumps(heldout(model, rows(flags["heldout_dir"]), collate)))
    with torch.inference_mode():
        export_speculative_decoding(model, export_dir=str(out / "export"))


def heldout(model, rows, collate) -> dict:
    """ModelOpt's loss and step-0 ``train_acc`` over the held-out rows, weighted by each row's counted tokens."""
    import torch

    total, loss, acc = 0, 0.0, 0.0
    with torch.no_grad():
        for i in range(len(rows)):
            batch = collate([rows[i]])
            n = int(batch["loss_mask"][:, 1:].sum())  # what step 0 counts: the mask from position 1 on
            if n:
                res = model(**batch)
                loss, acc, total = loss + float(res.loss) * n, acc + res.train_acc[0][0] * n, total + n
    return {"loss": loss / total if total else None, "acc_step0": acc / total if total else None, "tokens": total}


def modelopt_missing(site: str | None) -> str | None:
    """None when ModelOpt imports with ``site`` on the path (checked in a child), else why not."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", "import modelopt.torch.speculative"], env=env, capture_output=True,
                       text=True)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["import failed"])[-1]


def run_modelopt(args, dtype: str, ttt: int, root: Path, data: dict) -> dict:
    out = root / f"theirs-{dtype}-ttt{ttt}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--modelopt-child",
           json.dumps(modelopt_flags(args, dtype, ttt, data, out))]
    env = {**cs.env_for(args), "PYTHONPATH": os.pathsep.join(filter(None, [args.modelopt_site,
                                                                          os.environ.get("PYTHONPATH")]))}
    print(f"\n$ PYTHONPATH={env['PYTHONPATH']} OMP_NUM_THREADS={args.threads} {shlex.join(cmd)}", flush=True)
    result = cs.measure(cmd, env, root / f"{out.name}.log")
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()] \
        if (out / "steps.jsonl").exists() else []
    val = json.loads((out / "val.json").read_text()) if (out / "val.json").exists() else None
    return {**result, **cs.rates(steps, args.skip_steps), "command": cmd, "log": str(root / f"{out.name}.log"),
            "toolkit": "modelopt", "first_loss": steps[0]["loss"] if steps else None,
            "last_loss": steps[-1]["loss"] if steps else None,
            "heldout": {"loss": val["loss"], "full_acc_step0": val["acc_step0"]} if val else None,
            "head_dir": str(out / "export") if (out / "export" / "config.json").exists() else None}


# --------------------------------------------------------------------------- main


def report(args, root: Path, data: dict | None, results: list[dict]) -> dict:
    """compare_speculators.py's report as a ``trainer_compare`` against the peer ``modelopt``, with its version."""
    out = cs.report(args, root, data, results)
    versions = {k: v for k, v in out["versions"].items() if k != "speculators"}
    site = args.modelopt_site
    dist = next(Path(site).glob("nvidia_modelopt-*.dist-info"), None) if site else None
    versions["modelopt"] = dist.name.removesuffix(".dist-info").split("-")[1] if dist else None
    return {**out, "kind": "trainer_compare", "peer": "modelopt", "versions": versions,
            "budget": {"epochs": args.epochs}}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--modelopt-child"]:
        return modelopt_child(json.loads(argv[1]))
    args = parse_args(argv)
    if args.reuse:
        args, data, results = cs.reused(args, "modelopt")
        return cs.finish(args, Path(args.workdir), data, results, report)
    settings = [cs.parse_setting(s) for s in args.settings]
    trainers = [args.only] if args.only else ["ours", "theirs"]
    if "theirs" in trainers and (why := modelopt_missing(args.modelopt_site)):
        print(f"SKIP ModelOpt: {why}; give --modelopt-site (a folder holding nvidia-modelopt 0.47)", file=sys.stderr)
        trainers.remove("theirs")
        if not trainers:
            return
    root = Path(args.workdir or tempfile.mkdtemp(prefix="compare-modelopt-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    data = None
    if "theirs" in trainers:
        from transformers import AutoConfig

        from specheads.targets import resolve_target_path

        vocab = AutoConfig.from_pretrained(resolve_target_path(args.target)).vocab_size
        t0 = time.perf_counter()
        data = convert_store(args.features, args.prepared, root / "modelopt-data", vocab, args.draft_vocab_size,
                             args.eval_samples, args.seed)
        print(f"ModelOpt data: {data['num_train']} training rows ({data['train_tokens']} tokens) + "
              f"{data['num_heldout']} held out, in {root / 'modelopt-data'} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    results = cs.train_both(args, settings, trainers, root, data,
                            lambda dtype, ttt: run_modelopt(args, dtype, ttt, root, data))
    cs.finish(args, root, data, results, report)


if __name__ == "__main__":
    main()
