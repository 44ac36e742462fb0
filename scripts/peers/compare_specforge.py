"""Benchmark our EAGLE-3 or DFlash trainer against SGLang SpecForge's on the same target, rows and settings (run by
hand).

    python scripts/peers/compare_specforge.py --specforge-site /tmp/specforge-site \
        --features runs/quickstart/features --prepared runs/quickstart/prepared --epochs 1 --evaluate --json sf.json
    ... --settings bfloat16:3 bfloat16:7     # TTT steps (bfloat16 only: see below), each trained by both
    ... --method dflash --evaluate --json sf-dflash.json   # DFlash (block 8, 32 anchors a row: the section below)
    ... --method dflash --max-steps 4 --warmup-steps 1     # a smoke test: 4 optimizer steps each
    ... --only ours                          # our trainer alone (SpecForge need not be installed)
    python scripts/peers/compare_specforge.py --reuse sf.json --json sf-eval.json   # evaluate those heads again
    python scripts/peers/compare_specforge.py --reuse sf.json --serve --json sf-served.json  # serve both in vLLM

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
- AdamW's betas: SpecForge's are torch's (0.9, 0.999), ours (0.9, 0.95) (``--our-arg=optim.betas=[0.9,0.999]`` gives
  ours SpecForge's; SpecForge has no setting for them).
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

``--method dflash`` compares SpecForge's DFlash trainer (``training.strategy=dflash``) with ours (``method=dflash``).
SpecForge's DFlash path runs on a CPU unpatched: its DFlash layer is plain torch (the Triton/Liger kernels of
``dflash_kernels.py`` load only with ``model.use_liger_kernel``), ``training.attention_backend=sdpa`` builds a dense
mask, and its loss is plain ``F.cross_entropy``. Its data (``<workdir>/specforge-data-dflash``, same files and split):
``input_ids``, ``loss_mask`` (ours as it is: both count the token at ``anchor + j`` with ``loss_mask[anchor + j]``) and
``hidden_states [1,T,3H]``, the store's fused layers; no last state (its labels are the data's tokens) and no vocab
mapping. SpecForge refuses a row without two consecutive answer tokens (its anchors need ``loss_mask[a]`` and
``loss_mask[a + 1]``) and its own data preparation filters such rows out: they are left out of its rows (listed as
``left_out`` in convert.json), while ours trains them. Its draft config (z-lab's DFlash format: ``DFlashDraftModel``,
a Qwen3 layer with q/k norms) names ``dflash_config.target_layer_ids`` (our aux layers minus one) and
``mask_token_id`` itself: SpecForge sets them at run time only, and its export copies the draft config. The checkpoint
becomes a model folder through ``specforge export --to hf`` (its ``sglang`` exporter takes EAGLE-3 only), which
``specheads.export.foreign`` reads as z-lab's DFlash format, each tensor computing what SpecForge's layer computes (a
test checks the states). Matched (each setting is then ``bfloat16``, no TTT steps):
- one full-attention draft layer of the target's shape, blocks of ``--block-size`` (8), the target's frozen embedding
  and LM head over its whole vocabulary, the aux layers;
- the mask token (our default rule, ``model.mask_token_id``);
- ``--anchors`` (32) blocks per row per step, drawn without replacement (``training.num_anchors``; both per padded row);
- the labels: the data's tokens (SpecForge has no other; ours ``method.labels=data``, unlike the main job's ``target``);
- the loss: ``--loss ce``, slot j weighted ``exp(-(j-1)/--gamma)`` (4), the weighted mean over the counted slots
  (SpecForge's ``loss_type=dflash`` with ``loss_decay_gamma``; ours ``method.loss=ce``: the same formula and
  normaliser), or ``--loss dpace``, D-PACE's weights (``loss_type=dpace``; ``method.loss=dpace``), whose normaliser
  differs: SpecForge divides by the batch's rows, ours by its counted slots (a factor of about anchors x (B - 1), the
  counted slots of a row, which AdamW undoes but gradient clipping at 1.0 does not);
- the random start of the draft layer (``method.init_layer_from_target=false``), AdamW, warm-up, clipping and steps
  as for EAGLE-3.
Differences left (DFlash):
- the anchors: SpecForge's need the anchor itself in the loss mask (``loss_mask[a]``, ``a >= 0``), ours the token after
  it (``a >= 1``): ours also anchors at the last prompt token, the one that drafts an answer's first tokens;
- SpecForge's RoPE: its draft is cast to bf16 whole, its rotary inverse frequencies included, and transformers' Qwen3
  rotary embedding recomputes cos/sin from them at every forward; serving (and our evaluator) computes them in
  float32. The angles differ by up to 0.7 rad at position 500 for SmolLM2 (theta 1e5, head size 64);
- precision (bf16 weights and LM head vs our bf16 autocast over float32), batches, the learning-rate floor and AdamW's
  betas, as for EAGLE-3;
- the held-out figures: ours is slot 1's top-1 (``step0_acc``, against the data's tokens now), SpecForge's
  ``eval/avg_acc`` is every counted slot's top-1 together (reported as ``top1_all_slots``).
Refused families: ``--method peagle`` and ``--method dspark`` (``REFUSED`` says why, with SpecForge's file and line).
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
# the families SpecForge 0.2 trains offline on a CPU into a folder our evaluator reads (compare_speculators' METHODS)
METHODS = ("eagle3", "dflash")
REFUSED = {  # the other families of compare_speculators' METHODS: why this script cannot compare them
    "peagle": "SpecForge 0.2.0's P-EAGLE attends through flex attention only (modeling/draft/peagle.py:75, no "
              "sdpa path), and torch's flex attention has no backward on a CPU ('FlexAttention does not support "
              "backward on CPU'); its export (specforge export --to hf: architectures [PEagleDraftModel]) is no "
              "format specheads evaluate reads (specheads/export/foreign.py reads P-EAGLE in speculators' format "
              "only)",
    "dspark": "SpecForge 0.2.0's DSpark trains block slot k on the token at anchor + k + 1 (algorithms/common/"
              "dflash_family_model.py:764; its DFlash and the specheads DSpark head: anchor + k), and its export "
              "(architectures [DSparkDraftModel]) is no format specheads evaluate reads (specheads/export/foreign.py "
              "reads DSpark in speculators' format only)",
}
DFLASH_LOSSES = {"ce": "dflash", "dpace": "dpace"}  # our method.loss -> SpecForge's training.loss_type


def parse_args(argv=None) -> argparse.Namespace:
    p = cs.common_arguments(__doc__)
    p.add_argument("--specforge-site", default=None, help="the folder holding SpecForge (on the child's PYTHONPATH)")
    p.add_argument("--method", choices=cs.METHODS, default="eagle3",
                   help=f"the drafter family both trainers train ({', '.join(METHODS)}; the others are refused)")
    p.add_argument("--settings", nargs="+", default=None, metavar="bfloat16[:TTT]",
                   help="each trained by both: TTT steps for EAGLE-3 (default bfloat16:3), the dtype alone for DFlash "
                        "(bfloat16); SpecForge trains in bf16 only")
    p.add_argument("--block-size", type=int, default=8, help="DFlash: the block, the anchor and B-1 drafts (both)")
    p.add_argument("--anchors", type=int, default=32, help="DFlash: blocks per row per step (both)")
    p.add_argument("--loss", choices=sorted(DFLASH_LOSSES), default="ce",
                   help="DFlash: ce, slot j weighted exp(-(j-1)/--gamma) (SpecForge's dflash loss); dpace: D-PACE's "
                        "weights (SpecForge's dpace loss, which divides by the batch's rows: see the module doc)")
    p.add_argument("--gamma", type=float, default=4.0, help="DFlash, --loss ce: the slot decay (both)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training rows (both trainers)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="train N optimizer steps, fewer than --epochs gives (a smoke test: both learning-rate "
                        "schedules then span N steps)")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="tokens per batch (ours: padded); SpecForge gets rows per step for the same step count")
    p.add_argument("--their-arg", action="append", default=[], metavar="DOTTED=VALUE",
                   help="an extra SpecForge config override (e.g. --their-arg=training.max_grad_norm=0.5)")
    known, _ = p.parse_known_args(argv)
    p.set_defaults(settings=["bfloat16:3"] if known.method == "eagle3" else ["bfloat16"])
    args = cs.checked_args(p, argv)
    if args.method in REFUSED:
        p.error(f"--method {args.method}: {REFUSED[args.method]}")
    args.our_arg = match_ours(args) + args.our_arg
    args.minutes = None  # what compare_speculators' shared functions read
    return args


def match_ours(args) -> list[str]:
    """Our overrides (after compare_speculators' ``our_method_overrides``) that give SpecForge's recipe: EAGLE-3's
    random draft layer and trained LM head; DFlash's data labels and loss."""
    cap = ["data.epochs=null", f"train.max_steps={args.max_steps}"] if args.max_steps else []  # data.epochs sets it
    if args.method == "dflash":
        return ["method.labels=data", f"method.loss={args.loss}", f"method.gamma={args.gamma}", *cap]
    return MATCH_OURS + cap


def parse_setting(text: str) -> tuple[str, int]:
    dtype, ttt = cs.parse_setting(text)
    if dtype != "bfloat16":
        raise SystemExit(f"--settings {text!r}: SpecForge trains in bfloat16 only (its target head is cast to bf16 and "
                         "the draft's weights follow); give bfloat16:N (EAGLE-3) or bfloat16")
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


def target_text_config(target_dir: str | Path):
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(str(target_dir))
    return getattr(tc, "text_config", None) or tc


def layer_fields(tc) -> dict:
    """One draft layer of the target's shape (heads, kv heads, head size, MLP width, norm eps, rope theta), the
    target's vocabulary and special tokens: what both of SpecForge's draft configs take from the target."""
    theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta") or getattr(tc, "rope_theta", 10000.0)
    return {"hidden_size": tc.hidden_size, "intermediate_size": tc.intermediate_size,
            "num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads,
            "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            "num_hidden_layers": 1, "hidden_act": tc.hidden_act, "rms_norm_eps": tc.rms_norm_eps,
            "max_position_embeddings": tc.max_position_embeddings, "rope_theta": theta, "rope_scaling": None,
            "attention_bias": False, "tie_word_embeddings": False, "vocab_size": tc.vocab_size,
            "pad_token_id": tc.pad_token_id, "bos_token_id": tc.bos_token_id, "eos_token_id": tc.eos_token_id,
            "torch_dtype": "bfloat16"}


def draft_config(target_dir: str | Path, draft_vocab_size: int) -> dict:
    """SpecForge's EAGLE-3 draft config (``LlamaForCausalLMEagle3``): one layer of the target's shape."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            **layer_fields(target_text_config(target_dir)), "draft_vocab_size": draft_vocab_size}


def dflash_draft_config(target_dir: str | Path, aux_layers: list[int], block_size: int, mask_token_id: int) -> dict:
    """SpecForge's DFlash draft config (``DFlashDraftModel``, a Qwen3 config: q/k norms), z-lab's format, which its
    export writes as it is: one full-attention layer of the target's shape, ``block_size``, the target's whole
    vocabulary, ``dflash_config.target_layer_ids`` (decoder-layer outputs: our aux layers minus one) and
    ``dflash_config.mask_token_id`` (SpecForge sets both at run time only, so the export would lack them)."""
    tc = target_text_config(target_dir)
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **layer_fields(tc),
            "block_size": block_size, "num_target_layers": tc.num_hidden_layers, "target_hidden_size": tc.hidden_size,
            "layer_types": ["full_attention"], "use_sliding_window": False, "sliding_window": None,
            "dflash_config": {"target_layer_ids": [i - 1 for i in aux_layers], "mask_token_id": mask_token_id}}


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
                  draft_vocab_size: int, eval_samples: int = 16, seed: int = 0, check_rows: int = 4,
                  method: str = "eagle3") -> dict:
    """Write our feature store as SpecForge's offline rows of ``method``'s layout in ``out`` (see the module doc);
    returns what was written (also ``out/convert.json``; an ``out`` whose convert.json matches the store and settings
    is reused)."""
    import torch

    from specheads.data.features import ARGMAX_KEY
    from specheads.models.vocab import build_draft_vocab, count_loss_tokens

    out = Path(out)
    fmt = CONVERT_FORMAT if method == "eagle3" else f"{CONVERT_FORMAT}+{method}"
    store, key, earlier = cs.cached_conversion(features, out, fmt, draft_vocab_size, eval_samples, seed)
    if earlier:
        return earlier
    done = out / "convert.json"
    out.mkdir(parents=True)
    head = target_weights(target_dir)
    train_idx, eval_idx = cs.heldout_split(store, eval_samples, seed)
    norm = {"state": None}
    if method == "dflash":  # SpecForge's DFlash reads no last state (its labels are the data's tokens)
        norm = {"state": "unused"}
    else:
        probe = [store[i] for i in list(train_idx)[:check_rows]]
        if all(ARGMAX_KEY in item for item in probe):
            norm = final_norm_check([(it["hidden_last"], it[ARGMAX_KEY]) for it in probe], head["lm_head"],
                                    head["norm"], head["eps"])
    if norm["state"] is None:  # no stored argmax, or it cannot tell: the manifest says which state the store holds
        said = store.manifest.get("last", "")
        norm = {**norm, "state": "pre-norm" if said.startswith("pre-norm") else "post-norm", "from_manifest": said}
    ids, lengths, left_out = {}, [], []
    for split, rows in (("train", train_idx), ("heldout", eval_idx)):
        ids[split] = []
        for i in rows:
            item = store[i]
            row = dflash_row(item) if method == "dflash" else eagle3_row(item, norm["state"], head)
            if row is None:
                left_out.append(str(item["id"]))
                continue
            path = row_file(out / split, len(ids[split]))
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(row, path)
            ids[split].append(str(item["id"]))
            lengths.append(int(item["input_ids"].numel()))
    n_train = len(ids["train"])
    info = {**key, "method": method, "train_dir": str(out / "train"), "heldout_dir": str(out / "heldout"),
            "vocab_mapping": None, "num_train": n_train, "num_heldout": len(ids["heldout"]), "left_out": left_out,
            "ids": ids["train"] + ids["heldout"], "train_tokens": int(sum(lengths[:n_train])),
            "lengths": lengths, "max_length": max(lengths), "aux_layers": list(store.manifest["aux_layers"]),
            "num_layers": store.manifest.get("num_layers"), "last_state": norm,
            "store_dtype": store.manifest["dtype"], "hidden_dtype": "bfloat16", "lm_head_key": head["lm_head_key"]}
    if method == "eagle3":  # our draft vocabulary as SpecForge's vocab mapping (DFlash drafts over the whole one)
        vocab = count_loss_tokens(str(prepared), int(head["lm_head"].shape[0]), rows=ids["train"])
        d2t, t2d = build_draft_vocab(vocab, draft_vocab_size)
        torch.save({"d2t": d2t.long(), "t2d": t2d.bool()}, out / "vocab_mapping.pt")
        info["vocab_mapping"] = str(out / "vocab_mapping.pt")
    done.write_text(json.dumps(info))
    return info


def eagle3_row(item: dict, state: str, head: dict) -> dict:
    """One row of SpecForge's EAGLE-3 (offline) layout: the answer mask shifted, the fused layers and the target's
    post-norm last state (a pre-norm store's gets the target's final norm here)."""
    import torch

    last = item["hidden_last"]
    if state == "pre-norm":
        last = rms_norm(last, head["norm"], head["eps"])
    return {"input_ids": item["input_ids"].long(), "loss_mask": specforge_loss_mask(item["loss_mask"]),
            "aux_hidden_state": item["hidden_aux"].to(torch.bfloat16)[None].contiguous(),
            "hidden_state": last.to(torch.bfloat16)[None].contiguous()}


def dflash_row(item: dict) -> dict | None:
    """One row of SpecForge's DFlash (offline) layout: our answer mask as it is (both count the token at
    ``anchor + j`` with ``loss_mask[anchor + j]``) and the fused layers as ``hidden_states``. None for a row without
    two consecutive answer tokens, which SpecForge's offline reader refuses (its anchors need ``loss_mask[a]`` and
    ``loss_mask[a + 1]``; algorithms/common/dflash_family_data.py, ``normalize_offline_sample``) and its own data
    preparation leaves out (``loss_mask_filter``)."""
    import torch

    mask = item["loss_mask"].bool()
    if not bool((mask[:-1] & mask[1:]).any()):
        return None
    return {"input_ids": item["input_ids"].long(), "loss_mask": item["loss_mask"].long(),
            "hidden_states": item["hidden_aux"].to(torch.bfloat16)[None].contiguous()}


# --------------------------------------------------------------------------- the settings mapping


def specforge_steps(args, data: dict) -> tuple[int, int]:
    """(SpecForge's rows per step, its optimizer steps): our steps per epoch of ``--max-tokens`` batches over the
    training rows, times ``--epochs``, or ``--max-steps`` (fewer). Refuses a warm-up as long as the run, which
    SpecForge's cosine schedule cannot take (it divides by the steps left after the warm-up: ZeroDivisionError)."""
    n_train = data["num_train"]
    lengths = data["lengths"][:n_train]
    batch = max(1, round(n_train / our_batch_count(lengths, args.max_tokens)))
    total = (n_train // batch) * args.epochs
    if args.max_steps and args.max_steps > total:
        raise SystemExit(f"--max-steps {args.max_steps}: --epochs {args.epochs} gives SpecForge {total} steps; cap "
                         "fewer (or leave --max-steps out)")
    total = args.max_steps or total
    if args.warmup_steps >= total:
        raise SystemExit(f"--warmup-steps {args.warmup_steps} >= SpecForge's {total} optimizer steps: its cosine "
                         "schedule needs steps after the warm-up; give fewer warm-up steps")
    return batch, total


def specforge_config(args, ttt: int, data: dict, out: Path, target_dir: str, draft_config_path: str) -> dict:
    """SpecForge's run config (its typed schema) for one setting: ours mapped as the module doc says."""
    batch, total = specforge_steps(args, data)
    warmup_ratio = min(1.0, (args.warmup_steps + 0.5) / total) if args.warmup_steps else 0.0
    model = {"target_model_path": target_dir, "draft_model_config": draft_config_path,
             "embedding_key": "model.embed_tokens.weight", "lm_head_key": data["lm_head_key"],
             "torch_dtype": "bfloat16"}
    training = {"num_epochs": args.epochs, "batch_size": batch, "learning_rate": args.lr, "lr_scheduler": "cosine",
                "warmup_ratio": warmup_ratio, "max_grad_norm": OUR_MAX_GRAD_NORM, "attention_backend": "sdpa",
                "fsdp_sharding": "NO_SHARD", "save_interval": total, "eval_interval": total, "log_interval": 10,
                "seed": args.seed, **({"max_steps": total} if args.max_steps else {})}
    if cs.method_of(args) == "dflash":
        model["mask_token_id"] = args.mask_token
        training.update({"strategy": "dflash", "num_anchors": args.anchors, "loss_type": DFLASH_LOSSES[args.loss],
                         "loss_decay_gamma": args.gamma if args.loss == "ce" else None})
    else:
        model.update({"vocab_mapping_path": data["vocab_mapping"], "load_target_embedding": True,
                      "aux_hidden_state_layer_ids": [i - 1 for i in data["aux_layers"]]})
        training.update({"strategy": "eagle3", "ttt_length": ttt})
    return {
        "model": model,
        "data": {"hidden_states_path": data["train_dir"], "eval_hidden_states_path": data["heldout_dir"],
                 "max_length": data["max_length"], "cache_dir": str(out / "cache"), "dataloader_num_workers": 0},
        "training": training,
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


def real_tokens(tensors) -> int:
    """The non-padding tokens of one of SpecForge's batches: its attention mask's (EAGLE-3), else the rows whose
    fused states are not all zero (DFlash's batches carry no mask; its collator pads every tensor with zeros)."""
    mask = tensors.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    return int(tensors["hidden_states"].ne(0).any(-1).sum())


def specforge_child(config_path: str, steps_path: str) -> int:
    """Train with SpecForge's own CLI in this process (EAGLE-3: loss shim installed); one JSON line per optimizer step
    to ``steps_path`` and its held-out metrics to ``val.json`` beside it."""
    import specforge.training.assembly as assembly
    import specforge.training.controller as controller
    from specforge.cli import main as specforge_main

    if json.loads(Path(config_path).read_text())["training"]["strategy"] == "eagle3":
        install_loss_shim()
    log, val_path = open(steps_path, "w"), Path(steps_path).with_name("val.json")
    state = {"tokens": 0, "train_s": 0.0, "last": None, "steps": 0}
    train_step = controller.TrainerCore.train_step

    def timed(self, batch, ctx=None):
        state["last"] = state["last"] or time.perf_counter()
        state["tokens"] += real_tokens(batch.tensors)
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


def specforge_missing(site: str | None, method: str = "eagle3") -> str | None:
    """None when SpecForge's ``method`` trainer imports with ``site`` on the path (checked in a child), else why
    not."""
    import subprocess

    family = {"eagle3": "specforge.algorithms.eagle3.model",
              "dflash": "specforge.algorithms.common.dflash_family_model"}[method]
    env = {**os.environ, "SPECFORGE_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", f"import specforge.cli, {family}"], env=env, capture_output=True,
                       text=True)
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


def their_draft_config(args, data: dict) -> dict:
    from specheads.targets import resolve_target_path

    target = resolve_target_path(args.target)
    if cs.method_of(args) == "dflash":
        return dflash_draft_config(target, data["aux_layers"], args.block_size, args.mask_token)
    return draft_config(target, args.draft_vocab_size)


def export_command(args, ckpt: str, draft_path: Path, out: Path, data: dict) -> list[str]:
    """SpecForge's own exporter: EAGLE-3 to SGLang's layout (with our vocab mapping), DFlash to the HF folder
    (``--to hf``: its ``sglang`` exporter takes EAGLE-3 only), which is z-lab's DFlash format."""
    head = [sys.executable, "-m", "specforge.cli", "export", "--checkpoint", ckpt, "--draft-config", str(draft_path),
            "--output-dir", str(out)]
    if cs.method_of(args) == "dflash":
        return head + ["--to", "hf"]
    return head + ["--to", "sglang", "--vocab-mapping", data["vocab_mapping"]]


def their_heldout(args, val: dict | None) -> dict | None:
    """SpecForge's held-out figures: ``eval/avg_loss`` and ``eval/avg_acc`` (EAGLE-3: TTT step 0's top-1; DFlash:
    the top-1 of every counted block slot together, against the data's tokens)."""
    if not val:
        return None
    acc = "top1_all_slots" if cs.method_of(args) == "dflash" else "top1_step0"
    return {"loss": val.get("eval/avg_loss"), acc: val.get("eval/avg_acc")}


def run_specforge(args, dtype: str, ttt: int, root: Path, data: dict, target_dir: str) -> dict:
    out = root / cs.run_folder(args, "theirs", dtype, ttt)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    draft_path = out / "draft_config.json"
    draft_path.write_text(json.dumps(their_draft_config(args, data), indent=1))
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
        export = export_command(args, ckpt, draft_path, out / "export", data)
        print(f"$ {shlex.join(export)}", flush=True)
        exported = cs.measure(export, env, root / f"{out.name}-export.log")
        if exported["rc"] == 0 and (out / "export" / "config.json").exists():
            if cs.method_of(args) == "eagle3":
                add_aux_layers(out / "export", data["aux_layers"], data.get("num_layers"))
            head_dir = str(out / "export")
        else:
            print(f"SpecForge export failed (exit {exported['rc']}); log {out.name}-export.log", file=sys.stderr)
    return {**result, **cs.rates(steps, args.skip_steps), "command": cmd, "log": str(root / f"{out.name}.log"),
            "toolkit": "specforge", "batch_size": config["training"]["batch_size"],
            "first_loss": steps[0]["loss"] if steps else None, "last_loss": steps[-1]["loss"] if steps else None,
            "heldout": their_heldout(args, val), "head_dir": head_dir}


# --------------------------------------------------------------------------- main


def report(args, root: Path, data: dict | None, results: list[dict]) -> dict:
    """compare_speculators.py's report, of kind ``trainer_compare`` with peer ``specforge`` and SpecForge's version."""
    out = cs.report(args, root, data, results)
    versions = {k: v for k, v in out["versions"].items() if k != "speculators"}
    site = args.specforge_site
    dist = next(Path(site).glob("specforge-*.dist-info"), None) if site else None
    versions["specforge"] = dist.name.removesuffix(".dist-info").split("-")[1] if dist else None
    store = {**out["store"], "last_state": (data or {}).get("last_state")} if out.get("store") else out.get("store")
    settings = out["settings"]
    if cs.method_of(args) == "dflash":  # the loss both train (ours: labels=data, SpecForge's only labels)
        settings = {**settings, "labels": "data", "loss": args.loss, "gamma": args.gamma if args.loss == "ce" else None}
    budget = {"epochs": args.epochs, **({"max_steps": args.max_steps} if getattr(args, "max_steps", None) else {})}
    return {**out, "kind": "trainer_compare", "peer": "specforge", "versions": versions, "store": store,
            "settings": settings, "budget": budget}


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
    if "theirs" in trainers and (why := specforge_missing(args.specforge_site, args.method)):
        print(f"SKIP SpecForge: {why}; give --specforge-site (a folder holding specforge 0.2)", file=sys.stderr)
        trainers.remove("theirs")
        if not trainers:
            return None
    root = Path(args.workdir or tempfile.mkdtemp(prefix="compare-specforge-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    args.mask_token = cs.mask_token(args.target) if args.method != "eagle3" else None
    data, target_dir = None, None
    if "theirs" in trainers:
        from specheads.targets import resolve_target_path

        target_path = resolve_target_path(args.target)
        t0 = time.perf_counter()
        folder = root / ("specforge-data" if args.method == "eagle3" else f"specforge-data-{args.method}")
        data = convert_store(args.features, args.prepared, folder, target_path, args.draft_vocab_size,
                             args.eval_samples, args.seed, method=args.method)
        target_dir = specforge_target(target_path, root / "specforge-target")
        specforge_steps(args, data)  # its schedule checked before either trainer runs
        print(f"SpecForge data: {data['num_train']} training rows ({data['train_tokens']} tokens) + "
              f"{data['num_heldout']} held out, last state {data['last_state']}, in {folder} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    results = cs.train_both(args, settings, trainers, root, data,
                            lambda dtype, ttt: run_specforge(args, dtype, ttt, root, data, target_dir))
    return cs.finish(args, root, data, results, report)


if __name__ == "__main__":
    sys.exit(main())
