"""Benchmark our EAGLE-3 trainer against SGLang SpecForge's on the same target, rows and settings (run by hand).

    python scripts/bench/compare_specforge.py --specforge-site /tmp/specforge-site \
        --features runs/quickstart/features --prepared runs/quickstart/prepared --epochs 1 --evaluate --json sf.json
    ... --settings bfloat16:3 bfloat16:7     # TTT steps (bfloat16 only: see below), each trained by both
    ... --only ours                          # our trainer alone (SpecForge need not be installed)
    python scripts/bench/compare_specforge.py --reuse sf.json --json sf-eval.json   # evaluate those heads again
    python scripts/bench/compare_specforge.py --reuse sf.json --serve --json sf-served.json  # serve both in vLLM

SpecForge (0.2) is not a dependency of this project. Install its wheel alone into a folder of its own
(``pip install --no-deps --target DIR specforge``) and give that folder as ``--specforge-site``. Its offline CPU path
needs nothing else the project's venv lacks: it does not import sglang or yunchang, and it runs on the venv's
torch and transformers, which are newer than the wheel pins. Its runs go in a fresh process with that folder on
``PYTHONPATH`` (``--specforge-child``, in this file). That process drives SpecForge's own entry point
(``specforge train --config``). Only one piece of SpecForge is patched, at run time and in that process only: its
EAGLE-3 KL loss, a Triton kernel that needs a GPU driver. It is replaced by the same math in plain torch (the mean,
over every batch position, of ``-sum_v mask * p * log_softmax(logits)``). Everything else is SpecForge's own
configuration:
- ``SPECFORGE_DEVICE=cpu`` (gloo);
- ``training.fsdp_sharding=NO_SHARD`` (DDP; FSDP refuses a CPU);
- ``training.attention_backend=sdpa`` (flex attention has no CPU backward);
- ``TORCHDYNAMO_DISABLE=1`` (its ``torch.compile`` helpers work on a CPU but recompile per shape; ours is eager);
- ``data.dataloader_num_workers=0`` (one process, like ours).
The trained checkpoint becomes a model folder through SpecForge's own exporter (``specforge export --to sglang``:
config.json + model.safetensors with ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), which
``specheads.export.foreign`` reads as the EAGLE-3 format.

Data: our feature store is converted once into SpecForge's offline layout (``<workdir>/specforge-data``):
- Files: ``train/rows_{g}-{g+2000}/data_{i}.ckpt`` (our trainer's training rows: same held-out split, same seed)
  and ``heldout/...`` (our held-out rows, SpecForge's ``data.eval_hidden_states_path``).
- Each file holds ``input_ids [T]``, ``loss_mask [T]``, ``aux_hidden_state [1,T,3H]`` (the store's fused layers,
  the inputs of decoder layers ``aux_layers``, i.e. SGLang's layer ids ``aux_layers - 1``) and ``hidden_state
  [1,T,H]``, the target's last state **after** its final norm, which SpecForge turns into the target's logits with
  the lm_head alone.
- The store's last state: ``final_norm_check`` tests which side of the final norm it is on, by recomputing the
  stored target argmax from ``lm_head(last)`` and from ``lm_head(norm(last))`` on a few rows. The main job's store is
  post-norm, and its bytes are copied as they are. A pre-norm store gets the target's final norm applied here.
- Hidden states are bfloat16 (the store's bytes for a bf16 store). SpecForge hard-casts its target head to bf16
  and rejects other feature dtypes.
- The answer mask is ours shifted left by two. SpecForge weighs the prediction made at position p (of token p + 2:
  it shifts the input ids and the target states by one and the mask not at all) with ``loss_mask[p]``; ours weighs
  the prediction of token j with ``loss_mask[j]``. Shifted, both count exactly the answer tokens, step by step.
- The draft vocabulary is ours (``build_draft_vocab`` over the training rows' loss tokens), given as
  ``model.vocab_mapping_path``: ``{"d2t", "t2d"}`` in the offset form both use. SpecForge then builds none of its own.
- The target folder: SpecForge's target head wants a ``*.index.json`` and the lm_head's key. A target with a single
  safetensors file gets a folder of symlinks plus a generated index. Tied embeddings read
  ``model.embed_tokens.weight``.

Each setting ``bfloat16:TTT`` trains both, one at a time, each in a fresh process with ``OMP_NUM_THREADS=--threads``,
for ``--epochs`` passes over the training rows. Matched:
- one draft layer of the target's shape (heads, kv heads, head size, MLP width, norm eps, rope theta);
- the draft vocabulary; the aux layers; TTT steps (``training.ttt_length``); step-loss decay 0.8 (SpecForge's fixed
  ``ploss_decay``, our default);
- AdamW at ``--lr`` with weight decay 0;
- ``--warmup-steps`` of linear warm-up (SpecForge takes a ratio: ``(warmup + 0.5) / total`` steps, which its
  ``int()`` turns back into exactly ``--warmup-steps``);
- gradient clipping at our ``train.max_grad_norm`` (1.0; SpecForge's default is 0.5);
- the frozen target embedding;
- the draft layer and LM head start random and train: SpecForge cannot start them from the target's weights, so ours
  is told ``method.init_layer_from_target=false method.init_lm_head_from_target=false method.freeze_lm_head=false``;
- answer-only loss rows, on the same tokens (the mask above), each step trained only where the target's argmax lies
  in the draft vocabulary (both trainers);
- the same number of optimizer steps per epoch. SpecForge's ``training.batch_size`` rows per step is the training
  rows over the number of our length-grouped batches of ``--max-tokens``.
Differences left:
- Precision: SpecForge keeps bf16 weights with fp32 AdamW masters, and its target head is bf16. Ours is bf16
  autocast over fp32 weights, with the target's logits in float32. A float32 setting is refused: SpecForge cannot
  train one without a code change.
- Batches: SpecForge draws random rows, pads them to the longest and drops the last incomplete batch of each epoch.
  Ours pads length-grouped rows up to ``--max-tokens``.
- The learning-rate decay: SpecForge's cosine goes to 0, ours to 0.1 x the peak.
- The loss's normaliser: SpecForge takes the mean over all B x T positions of a batch, padding and unmasked rows
  included; ours takes the mean over the counted rows.
- The initialisations' random draws.
Reported per run as compare_speculators.py reports:
- tokens/s, steady and overall (real tokens over the summed step times, data loading included);
- peak RSS and peak anon memory;
- steps and losses;
- held-out figures on the same held-out rows and tokens: ours is step-0 top-1 against the target's argmax over the
  whole vocabulary; SpecForge's is its ``eval/avg_loss`` and ``eval/avg_acc``, the same top-1 definition, one pass
  after the last step.
``--evaluate`` then decodes both heads with ``specheads evaluate`` (ours: the training folder; SpecForge's: its export)
on the main job's prompts, greedy and lossless-checked, in the same shapes (compare_speculators.py's ``run_eval``).
``--json`` writes the report (``kind: trainer_compare``, ``peer: specforge``), which ``specheads record`` files under
``trainer_comparisons``.
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
import compare_speculators as cs  # noqa: E402  (the shared store split, measuring, evaluation, tables and report)

CONVERT_FORMAT = "specheads.compare_specforge/1"
MATCH_OURS = ["method.init_layer_from_target=false", "method.init_lm_head_from_target=false",
              "method.freeze_lm_head=false"]  # SpecForge's draft layer and LM head start random and train
OUR_MAX_GRAD_NORM = 1.0  # conf/train.yaml's train.max_grad_norm, given to SpecForge too
ROWS_PER_FOLDER = 2000  # SpecForge's own capture writes rows_{g}-{g+2000}/data_{i}.ckpt
MASK_SHIFT = 2  # SpecForge weighs the prediction of token p + 2 with loss_mask[p]


def parse_args(argv=None) -> argparse.Namespace:
    p = cs.common_arguments(__doc__)
    p.add_argument("--specforge-site", default=None, help="the folder holding SpecForge (on the child's PYTHONPATH)")
    p.add_argument("--settings", nargs="+", default=["bfloat16:3"], metavar="bfloat16:TTT",
                   help="TTT steps, each trained by both (default: bfloat16:3; SpecForge trains in bf16 only)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training rows (both trainers)")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="tokens per batch (ours: padded); SpecForge gets rows per step for the same step count")
    p.add_argument("--their-arg", action="append", default=[], metavar="DOTTED=VALUE",
                   help="an extra SpecForge config override (e.g. --their-arg=training.max_grad_norm=0.5)")
    args = cs.checked_args(p, argv)
    args.our_arg = MATCH_OURS + args.our_arg
    args.minutes = None  # what compare_speculators' shared functions read
    return args


def parse_setting(text: str) -> tuple[str, int]:
    dtype, ttt = cs.parse_setting(text)
    if dtype != "bfloat16":
        raise SystemExit(f"--settings {text!r}: SpecForge trains in bfloat16 only (its target head is cast to bf16 and "
                         "the draft's weights follow); give bfloat16:N")
    return dtype, ttt


# --------------------------------------------------------------------------- the target's last state and head


def target_weights(target_dir: str | Path) -> dict:
    """The target's ``lm_head`` (V, H), final-norm weight (H,), norm eps and lm_head key, read from its folder."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(target_dir))
    config = getattr(config, "text_config", None) or config
    found = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
                    found[key] = st.get_tensor(key)
    head_key = "lm_head.weight" if "lm_head.weight" in found else "model.embed_tokens.weight"
    if head_key not in found or "model.norm.weight" not in found:
        raise SystemExit(f"{target_dir}: no lm_head/embed_tokens or model.norm weights in its safetensors files")
    return {"lm_head": found[head_key].float(), "norm": found["model.norm.weight"].float(),
            "eps": float(config.rms_norm_eps), "lm_head_key": head_key}


def rms_norm(x, weight, eps: float):
    import torch

    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def final_norm_check(rows: list[tuple], lm_head, norm, eps: float, min_agree: float = 0.9,
                     margin: float = 0.05) -> dict:
    """Which side of the target's final norm a stored last state is on.

    rows: ``(last (T, H), target_argmax (T,))`` pairs. The argmax of ``lm_head(last)`` and of ``lm_head(norm(last))``
    are compared with the stored argmax. Returns ``{"state": "post-norm" | "pre-norm" | None, "agree_as_is",
    "agree_normed"}``; state None when both readings agree alike (within ``margin``: a norm weight close to uniform
    leaves the argmax unchanged, so the argmax cannot tell). Raises when neither reading reproduces at least
    ``min_agree`` of the stored argmax.
    """
    import torch

    hits = {"as_is": 0, "normed": 0}
    total = 0
    for last, argmax in rows:
        last = last.float()
        hits["as_is"] += int(((last @ lm_head.T).argmax(-1) == argmax).sum())
        hits["normed"] += int(((rms_norm(last, norm, eps) @ lm_head.T).argmax(-1) == argmax).sum())
        total += int(argmax.numel())
    agree = {k: v / max(total, 1) for k, v in hits.items()}
    best = max(agree, key=agree.get)
    if agree[best] < min_agree:
        raise SystemExit(f"the store's last state reproduces the stored target argmax neither as it is "
                         f"({agree['as_is']:.1%}) nor after the final norm ({agree['normed']:.1%})")
    state = None if abs(agree["as_is"] - agree["normed"]) < margin else "post-norm" if best == "as_is" else "pre-norm"
    return {"state": state, "agree_as_is": agree["as_is"],
            "agree_normed": agree["normed"], "tokens": total}


def specforge_target(target_dir: str | Path, out: str | Path) -> str:
    """A target folder SpecForge's target head reads: ``target_dir`` itself when it has a ``*.index.json``, else a
    folder of symlinks to its files plus a ``model.safetensors.index.json`` naming every tensor's file."""
    from safetensors import safe_open

    target_dir, out = Path(target_dir).resolve(), Path(out)
    if list(target_dir.glob("*.index.json")):
        return str(target_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    weight_map = {}
    for f in sorted(target_dir.iterdir()):
        if f.is_file():
            (out / f.name).symlink_to(f)
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as st:
                weight_map.update({k: f.name for k in st.keys()})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(out)


def draft_config(target_dir: str | Path, draft_vocab_size: int) -> dict:
    """SpecForge's draft config (``LlamaForCausalLMEagle3``): one layer of the target's shape."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(str(target_dir))
    tc = getattr(tc, "text_config", None) or tc
    theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta") or getattr(tc, "rope_theta", 10000.0)
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": tc.hidden_size,
            "intermediate_size": tc.intermediate_size, "num_attention_heads": tc.num_attention_heads,
            "num_key_value_heads": tc.num_key_value_heads,
            "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            "num_hidden_layers": 1, "hidden_act": tc.hidden_act, "rms_norm_eps": tc.rms_norm_eps,
            "max_position_embeddings": tc.max_position_embeddings, "rope_theta": theta, "rope_scaling": None,
            "attention_bias": False, "tie_word_embeddings": False, "vocab_size": tc.vocab_size,
            "draft_vocab_size": draft_vocab_size, "pad_token_id": tc.pad_token_id, "bos_token_id": tc.bos_token_id,
            "eos_token_id": tc.eos_token_id, "torch_dtype": "bfloat16"}


# --------------------------------------------------------------------------- data: our store -> SpecForge's rows


def specforge_loss_mask(loss_mask):
    """(T,) our mask (token j counted at j) -> SpecForge's (the prediction of token p + 2 counted at p)."""
    import torch

    out = torch.zeros_like(loss_mask, dtype=torch.long)
    out[: max(loss_mask.numel() - MASK_SHIFT, 0)] = loss_mask[MASK_SHIFT:].long()
    return out


def row_file(root: Path, k: int) -> Path:
    g = k // ROWS_PER_FOLDER * ROWS_PER_FOLDER
    return root / f"rows_{g}-{g + ROWS_PER_FOLDER}" / f"data_{k}.ckpt"


def our_batch_count(lengths: list[int], max_tokens: int) -> int:
    """Our optimizer steps per epoch over rows of ``lengths`` (length-grouped batches of ``max_tokens``)."""
    from specheads.data.features import length_batches

    return len(length_batches(sorted(range(len(lengths)), key=lambda i: lengths[i]), lengths, max_tokens, None))


def convert_store(features: str | Path, prepared: str | Path, out: str | Path, target_dir: str | Path,
                  draft_vocab_size: int, eval_samples: int = 16, seed: int = 0, check_rows: int = 4) -> dict:
    """Write our feature store as SpecForge's offline rows in ``out`` (see the module doc); returns what was written
    (also ``out/convert.json``; an ``out`` whose convert.json matches the store and settings is reused)."""
    import torch

    from specheads.data.features import ARGMAX_KEY
    from specheads.models.vocab import build_draft_vocab, count_loss_tokens

    out = Path(out)
    store, key, earlier = cs.cached_conversion(features, out, CONVERT_FORMAT, draft_vocab_size, eval_samples, seed)
    if earlier:
        return earlier
    done = out / "convert.json"
    out.mkdir(parents=True)
    head = target_weights(target_dir)
    train_idx, eval_idx = cs.heldout_split(store, eval_samples, seed)
    probe = [store[i] for i in list(train_idx)[:check_rows]]
    norm = {"state": None}
    if all(ARGMAX_KEY in item for item in probe):
        norm = final_norm_check([(it["hidden_last"], it[ARGMAX_KEY]) for it in probe], head["lm_head"], head["norm"],
                                head["eps"])
    if norm["state"] is None:  # no stored argmax, or it cannot tell: the manifest says which state the store holds
        said = store.manifest.get("last", "")
        norm = {**norm, "state": "pre-norm" if said.startswith("pre-norm") else "post-norm", "from_manifest": said}
    ids, lengths = {}, []
    for split, rows in (("train", train_idx), ("heldout", eval_idx)):
        ids[split] = []
        for k, i in enumerate(rows):
            item = store[i]
            last = item["hidden_last"]
            if norm["state"] == "pre-norm":
                last = rms_norm(last, head["norm"], head["eps"])
            path = row_file(out / split, k)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"input_ids": item["input_ids"].long(), "loss_mask": specforge_loss_mask(item["loss_mask"]),
                        "aux_hidden_state": item["hidden_aux"].to(torch.bfloat16)[None].contiguous(),
                        "hidden_state": last.to(torch.bfloat16)[None].contiguous()}, path)
            ids[split].append(str(item["id"]))
            lengths.append(int(item["input_ids"].numel()))
    vocab = count_loss_tokens(str(prepared), int(head["lm_head"].shape[0]), rows=ids["train"])
    d2t, t2d = build_draft_vocab(vocab, draft_vocab_size)
    torch.save({"d2t": d2t.long(), "t2d": t2d.bool()}, out / "vocab_mapping.pt")
    n_train = len(train_idx)
    info = {**key, "train_dir": str(out / "train"), "heldout_dir": str(out / "heldout"),
            "vocab_mapping": str(out / "vocab_mapping.pt"), "num_train": n_train, "num_heldout": len(eval_idx),
            "ids": ids["train"] + ids["heldout"], "train_tokens": int(sum(lengths[:n_train])),
            "lengths": lengths, "max_length": max(lengths), "aux_layers": list(store.manifest["aux_layers"]),
            "num_layers": store.manifest.get("num_layers"), "last_state": norm,
            "store_dtype": store.manifest["dtype"], "hidden_dtype": "bfloat16", "lm_head_key": head["lm_head_key"]}
    done.write_text(json.dumps(info))
    return info


# --------------------------------------------------------------------------- the settings mapping


def specforge_config(args, ttt: int, data: dict, out: Path, target_dir: str, draft_config_path: str) -> dict:
    """SpecForge's run config (its typed schema) for one setting: ours mapped as the module doc says."""
    n_train = data["num_train"]
    lengths = data["lengths"][:n_train]
    batch = max(1, round(n_train / our_batch_count(lengths, args.max_tokens)))
    total = (n_train // batch) * args.epochs
    warmup_ratio = min(1.0, (args.warmup_steps + 0.5) / total) if args.warmup_steps else 0.0
    return {
        "model": {"target_model_path": target_dir, "draft_model_config": draft_config_path,
                  "embedding_key": "model.embed_tokens.weight", "lm_head_key": data["lm_head_key"],
                  "vocab_mapping_path": data["vocab_mapping"], "load_target_embedding": True,
                  "aux_hidden_state_layer_ids": [i - 1 for i in data["aux_layers"]], "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": data["train_dir"], "eval_hidden_states_path": data["heldout_dir"],
                 "max_length": data["max_length"], "cache_dir": str(out / "cache"), "dataloader_num_workers": 0},
        "training": {"strategy": "eagle3", "num_epochs": args.epochs, "batch_size": batch,
                     "learning_rate": args.lr, "lr_scheduler": "cosine", "warmup_ratio": warmup_ratio,
                     "max_grad_norm": OUR_MAX_GRAD_NORM, "ttt_length": ttt, "attention_backend": "sdpa",
                     "fsdp_sharding": "NO_SHARD", "save_interval": total, "eval_interval": total,
                     "log_interval": 10, "seed": args.seed},
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
        "run_id": "compare", "output_dir": str(out / "output"),
    }


def with_overrides(config: dict, overrides: list[str]) -> dict:
    """``config`` with ``--their-arg`` dotted overrides (``training.max_grad_norm=0.5``; values parsed as JSON,
    else kept as text)."""
    import copy

    config = copy.deepcopy(config)
    for item in overrides:
        dotted, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--their-arg {item!r}: expected DOTTED.KEY=VALUE")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        node, *path = config, *dotted.split(".")
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return config


# --------------------------------------------------------------------------- SpecForge's run (a child process)


def install_loss_shim() -> None:
    """Replace SpecForge's Triton KL loss (needs a GPU driver) with the same math in plain torch, in this process."""
    import torch

    import specforge.algorithms.eagle3.model as eagle3_model

    class TorchKL:
        @staticmethod
        def apply(logits, target_p, position_mask):
            logp = torch.log_softmax(logits.float(), dim=-1)
            return -(position_mask * (target_p * logp)).sum(-1).mean()

    eagle3_model.LogSoftmaxLoss = TorchKL


def specforge_child(config_path: str, steps_path: str) -> int:
    """Train with SpecForge's own CLI in this process (loss shim installed); one JSON line per optimizer step to
    ``steps_path`` and its held-out metrics to ``val.json`` beside it."""
    import specforge.training.assembly as assembly
    import specforge.training.controller as controller
    from specforge.cli import main as specforge_main

    install_loss_shim()
    log, val_path = open(steps_path, "w"), Path(steps_path).with_name("val.json")
    state = {"tokens": 0, "train_s": 0.0, "last": None, "steps": 0}
    train_step = controller.TrainerCore.train_step

    def timed(self, batch, ctx=None):
        state["last"] = state["last"] or time.perf_counter()
        state["tokens"] += int(batch.tensors["attention_mask"].sum())  # real tokens (padding is 0)
        result = train_step(self, batch, ctx)
        if result.optimizer_stepped:
            now = time.perf_counter()
            state["train_s"] += now - state["last"]
            state["last"] = now
            state["steps"] += 1
            log.write(json.dumps({"step": state["steps"], "tokens": state["tokens"], "train_s": state["train_s"],
                                  "loss": float(result.metrics.get("loss", float("nan")))}) + "\n")
            log.flush()
        return result

    printer = assembly._logger

    def logger(metrics, step):
        printer(metrics, step)
        held = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if held:
            as_float = {k: [float(x) for x in v] if isinstance(v, (list, tuple)) else float(v) for k, v in held.items()}
            val_path.write_text(json.dumps({**as_float, "step": step}))

    controller.TrainerCore.train_step = timed
    assembly._logger = logger
    try:
        return int(specforge_main(["train", "--config", config_path]) or 0)
    finally:
        log.close()


def specforge_env(args) -> dict:
    return {**cs.env_for(args), "SPECFORGE_DEVICE": "cpu", "TORCHDYNAMO_DISABLE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [args.specforge_site, os.environ.get("PYTHONPATH")]))}


def specforge_missing(site: str | None) -> str | None:
    """None when SpecForge's trainer imports with ``site`` on the path (checked in a child), else why not."""
    import subprocess

    env = {**os.environ, "SPECFORGE_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", "import specforge.cli, specforge.algorithms.eagle3.model"], env=env,
                       capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["import failed"])[-1]


def last_checkpoint(output_dir: Path) -> str | None:
    """SpecForge's newest ``<run_id>-step{N}`` checkpoint folder, if any."""
    steps = [d for d in output_dir.glob("*-step*") if d.is_dir() and d.name.rpartition("-step")[2].isdigit()]
    return str(max(steps, key=lambda d: int(d.name.rpartition("-step")[2]))) if steps else None


def add_aux_layers(export_dir: Path, aux_layers: list[int], num_layers: int | None) -> bool:
    """SpecForge's export names no aux layers (readers assume (2, N//2, N-3) as decoder-layer inputs): record ours
    (SGLang's ids, one less) in its config.json's ``eagle_config`` when they differ from that. True if written."""
    if num_layers and list(aux_layers) == [2, num_layers // 2, num_layers - 3]:
        return False
    cfg_path = export_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in aux_layers]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return True


def run_specforge(args, dtype: str, ttt: int, root: Path, data: dict, target_dir: str) -> dict:
    from specheads.targets import resolve_target_path

    out = root / f"theirs-{dtype}-ttt{ttt}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    draft_path = out / "draft_config.json"
    draft_path.write_text(json.dumps(draft_config(resolve_target_path(args.target), args.draft_vocab_size), indent=1))
    config = with_overrides(specforge_config(args, ttt, data, out, target_dir, str(draft_path)), args.their_arg)
    (out / "run.json").write_text(json.dumps(config, indent=1))
    env = specforge_env(args)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--specforge-child", str(out / "run.json"),
           str(out / "steps.jsonl")]
    print(f"\n$ PYTHONPATH={env['PYTHONPATH']} OMP_NUM_THREADS={args.threads} {shlex.join(cmd)}", flush=True)
    result = cs.measure(cmd, env, root / f"{out.name}.log")
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()] \
        if (out / "steps.jsonl").exists() else []
    val = json.loads((out / "val.json").read_text()) if (out / "val.json").exists() else None
    head_dir, ckpt = None, last_checkpoint(out / "output")
    if result["rc"] == 0 and ckpt:
        export = [sys.executable, "-m", "specforge.cli", "export", "--to", "sglang", "--checkpoint", ckpt,
                  "--draft-config", str(draft_path), "--output-dir", str(out / "export"),
                  "--vocab-mapping", data["vocab_mapping"]]
        print(f"$ {shlex.join(export)}", flush=True)
        exported = cs.measure(export, env, root / f"{out.name}-export.log")
        if exported["rc"] == 0 and (out / "export" / "config.json").exists():
            add_aux_layers(out / "export", data["aux_layers"], data.get("num_layers"))
            head_dir = str(out / "export")
        else:
            print(f"SpecForge export failed (exit {exported['rc']}); log {out.name}-export.log", file=sys.stderr)
    return {**result, **cs.rates(steps, args.skip_steps), "command": cmd, "log": str(root / f"{out.name}.log"),
            "toolkit": "specforge", "batch_size": config["training"]["batch_size"],
            "first_loss": steps[0]["loss"] if steps else None, "last_loss": steps[-1]["loss"] if steps else None,
            "heldout": {"loss": val.get("eval/avg_loss"), "top1_step0": val.get("eval/avg_acc")} if val else None,
            "head_dir": head_dir}


# --------------------------------------------------------------------------- main


def report(args, root: Path, data: dict | None, results: list[dict]) -> dict:
    """compare_speculators.py's report, of kind ``trainer_compare`` with peer ``specforge`` and SpecForge's version."""
    out = cs.report(args, root, data, results)
    versions = {k: v for k, v in out["versions"].items() if k != "speculators"}
    site = args.specforge_site
    dist = next(Path(site).glob("specforge-*.dist-info"), None) if site else None
    versions["specforge"] = dist.name.removesuffix(".dist-info").split("-")[1] if dist else None
    store = {**out["store"], "last_state": (data or {}).get("last_state")} if out.get("store") else out.get("store")
    return {**out, "kind": "trainer_compare", "peer": "specforge", "versions": versions, "store": store,
            "budget": {"epochs": args.epochs}}


def main(argv=None) -> int | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--specforge-child"]:
        return specforge_child(argv[1], argv[2])
    args = parse_args(argv)
    if args.reuse:
        args, data, results = cs.reused(args, "specforge")
        return cs.finish(args, Path(args.workdir), data, results, report)
    settings = [parse_setting(s) for s in args.settings]
    trainers = [args.only] if args.only else ["ours", "theirs"]
    if "theirs" in trainers and (why := specforge_missing(args.specforge_site)):
        print(f"SKIP SpecForge: {why}; give --specforge-site (a folder holding specforge 0.2)", file=sys.stderr)
        trainers.remove("theirs")
        if not trainers:
            return None
    root = Path(args.workdir or tempfile.mkdtemp(prefix="compare-specforge-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    data, target_dir = None, None
    if "theirs" in trainers:
        from specheads.targets import resolve_target_path

        target_path = resolve_target_path(args.target)
        t0 = time.perf_counter()
        data = convert_store(args.features, args.prepared, root / "specforge-data", target_path,
                             args.draft_vocab_size, args.eval_samples, args.seed)
        target_dir = specforge_target(target_path, root / "specforge-target")
        print(f"SpecForge data: {data['num_train']} training rows ({data['train_tokens']} tokens) + "
              f"{data['num_heldout']} held out, last state {data['last_state']}, in {root / 'specforge-data'} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    results = cs.train_both(args, settings, trainers, root, data,
                            lambda dtype, ttt: run_specforge(args, dtype, ttt, root, data, target_dir))
    return cs.finish(args, root, data, results, report)


if __name__ == "__main__":
    sys.exit(main())
