"""Benchmark our EAGLE-3 or DFlash trainer against NVIDIA ModelOpt 0.47's on the same target, rows and settings (run by
hand).

    PYTHONPATH= python scripts/peers/compare_modelopt.py --modelopt-site /tmp/modelopt-site \
        --features runs/quickstart/features --prepared runs/quickstart/prepared --epochs 1 --evaluate --json mo.json
    ... --settings float32:1 bfloat16:3       # dtype (float32, or bfloat16 autocast) and TTT steps, both trainers
    ... --method dflash --evaluate --json mo-dflash.json   # DFlash (block 8, 32 anchors a row: the section below)
    ... --method dflash --max-steps 4 --warmup-steps 1     # a smoke test: 4 optimizer steps each
    ... --only ours                           # our trainer alone (ModelOpt need not be installed)
    python scripts/peers/compare_modelopt.py --reuse mo.json --json mo-eval.json   # evaluate those heads again
    python scripts/peers/compare_modelopt.py --reuse mo.json --serve --json mo-served.json  # serve both in vLLM

ModelOpt (nvidia-modelopt 0.47, with ``pulp`` and ``scipy`` that ``modelopt.torch`` imports) is not a dependency of
this project: install it into a folder of its own (``pip install --no-deps --target DIR nvidia-modelopt pulp scipy``)
and give it as ``--modelopt-site``; its runs go in a fresh process with that folder on ``PYTHONPATH``
(``--modelopt-child``, in this file). ModelOpt 0.47 supports transformers < 5.13; on a newer one the child patches two
renames at run time, in that process only: the decoder layer's ``past_key_values`` argument (now ``cache``; without it
the training-time-test KV cache would be lost) and the rotary embeddings' dropped ``device`` argument (EAGLE-3's
``LlamaRotaryEmbedding``, DFlash's ``Qwen3RotaryEmbedding``: plugins/modeling_dflash.py:388).

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
``--method dflash`` compares ModelOpt's DFlash trainer (its ``dflash`` mode: modelopt/torch/speculative/plugins/
hf_dflash.py) with ours (``method=dflash``). It trains on a CPU as it is: its draft is plain torch (transformers' SDPA
attention, Qwen3 MLP and norms), nothing in 0.47 reads ``dflash_use_torch_compile``, and its loss is plain
``F.cross_entropy``. One thing is patched, in the child only: ModelOpt gives its draft one fused target layer per draft
layer (hf_dflash.py:457 refuses other ``target_layer_ids``; :483 picks as many by default), so the child's
``build_target_layer_ids`` returns our aux layers (minus one) for its one draft layer: ``fc`` takes k·H, as ours and
z-lab's format do. Its data (``<workdir>/modelopt-data-dflash``: the same files, rows and split) holds the answer
mask as it is (both count the token at ``anchor + k`` with ``loss_mask[anchor + k]``); the last state stays in
``hidden_states`` (its offline reader requires it; nothing reads it without logit distillation). Its export
(``export_speculative_decoding``) is z-lab's DFlash format (``DFlashDraftModel``, ``dflash_config.target_layer_ids``:
decoder-layer outputs, ``mask_token_id``, ``causal: false``), which ``specheads.export.foreign`` reads as it is (a test
checks the states against ModelOpt's forward). Matched (each setting is then ``DTYPE`` alone: float32, or bfloat16
autocast, ModelOpt's through HF Trainer's ``bf16``; default bfloat16):
- one full-attention draft layer of the target's shape (heads, kv heads, head size, MLP width, activation, norm eps,
  rope theta: given, as ModelOpt's defaults would leave Qwen3Config's sizes and eps 1e-6), bidirectional within a block
  (``dflash_draft_attention``), blocks of ``--block-size`` (8, ModelOpt's default), the target's frozen embedding and
  LM head over its whole vocabulary, the aux layers;
- the mask token (our default rule, ``dflash_mask_token_id``);
- ``--anchors`` (32) blocks per row per step, drawn without replacement (``dflash_num_anchors``);
- the labels: the data's tokens (``dflash_self_logit_distillation=false``: ModelOpt's default distils the target's
  distribution, which ours cannot; ours ``method.labels=data``);
- the loss: ``--loss ce``, slot k weighted ``exp(-(k-1)/--gamma)`` (4, ModelOpt's suggestion for blocks of 8), the
  weighted mean over the counted slots (``dflash_loss_objective=decay`` with ``dflash_loss_decay_factor``; ours
  ``method.loss=ce``: the same formula and normaliser), or ``--loss dpace``, D-PACE's weights with alpha 0.5 on both
  (ModelOpt's default objective; ``method.loss=dpace``), whose normaliser differs: ModelOpt divides by the weights'
  sum, ours by the counted slots;
- the draft layer's random start (``method.init_layer_from_target=false``), AdamW at ``--lr`` with weight decay 0,
  ``--warmup-steps``, gradient clipping at 1.0 and ``--epochs`` as for EAGLE-3; ``--max-steps`` caps both.
Differences left (DFlash):
- the anchors: ModelOpt's need the anchor itself in the loss mask (``loss_mask[a]``), ours the token after it (``a >=
  1``): ours also anchors at the last prompt token, the one that drafts an answer's first tokens; ModelOpt draws at
  most the batch's largest count of valid anchors minus one per row (hf_dflash.py:622);
- a row's last token: ModelOpt's offline reader ends its shifted ``labels`` with -100, which its DFlash forward
  multiplies into the loss mask (hf_dflash.py:995), so that token is never an anchor or a label there; ours counts it;
- batches (ModelOpt: ``max_tokens // L`` rows per step, each padded to L: the longest row plus B-1, rounded up to a
  multiple of B, as its forward requires, so every row's anchors fit), the learning-rate floor (cosine to 0; ours 0.1 x
  the peak), AdamW's betas (HF Trainer's (0.9, 0.999); ours (0.9, 0.95): ``--our-arg=optim.betas=[0.9,0.999]
  --our-arg=optim.min_lr_ratio=0`` gives ours ModelOpt's) and the initialisations (ModelOpt: normal(0.02) for every
  linear layer);
- the held-out figures: ours is slot 1's top-1 (``step0_acc``, against the data's tokens), ModelOpt's its loss and
  ``train_acc`` (every counted slot's top-1 together: ``top1_all_slots``), on one draw of anchors from ``--seed`` (its
  offline forward runs in training mode only), weighted by each row's answer tokens.
Refused families: ``--method peagle`` and ``--method dspark`` (``REFUSED`` says why, with ModelOpt's file and line).
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
import compare_specforge as sf  # noqa: E402  (our side's matched overrides, the draft layer's shape)

REPO = cs.REPO
CONVERT_FORMAT = "specheads.compare_modelopt/1"
MATCH_OURS = sf.MATCH_OURS  # ModelOpt's EAGLE-3 draft layer and LM head start random and train, as SpecForge's
LOSS_DECAY = 0.8
# the families ModelOpt 0.47 trains offline on a CPU into a folder our evaluator reads (compare_speculators' METHODS)
METHODS = ("eagle3", "dflash")
REFUSED = {  # the other families of compare_speculators' METHODS: why this script cannot compare them
    "peagle": "ModelOpt 0.47 drafts several tokens per step (parallel_draft_step, P-EAGLE's kind) in its Megatron "
              "plugin only (modelopt/torch/speculative/plugins/megatron_eagle.py:526), which needs Megatron-Core; its "
              "HF trainer (plugins/hf_eagle.py) has no parallel drafting",
    "dspark": "ModelOpt 0.47's DSpark (the dflash mode with projector_type dspark; it does train on a CPU) trains "
              "block slot k on the token at anchor + k + 1 (modelopt/torch/speculative/plugins/hf_dspark.py:194; "
              "shift_label fixed true, plugins/modeling_dspark.py:95; its DFlash and the specheads DSpark head: "
              "anchor + k), and its export (architectures [DFlashDraftModel] with dflash_config.projector_type dspark "
              "and shift_label true, modelopt/torch/export/plugins/hf_spec_export.py:542) is refused by "
              "specheads/export/foreign.py",
}
DFLASH_OBJECTIVES = {"ce": "decay", "dpace": "dpace"}  # our method.loss -> ModelOpt's dflash_loss_objective


def parse_args(argv=None) -> argparse.Namespace:
    p = cs.common_arguments(__doc__)
    p.add_argument("--modelopt-site", default=None, help="the folder holding ModelOpt (put on the child's PYTHONPATH)")
    p.add_argument("--settings", nargs="+", default=None, metavar="DTYPE[:TTT]",
                   help="float32|bfloat16, each trained by both, with TTT steps for EAGLE-3 (default float32:1); the "
                        "dtype alone for DFlash (default bfloat16)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training rows (both trainers)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop both after N optimizer steps (a smoke test: both schedules then span N steps)")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per batch (ours: padded; ModelOpt: rows x L)")
    p.add_argument("--method", choices=cs.METHODS, default="eagle3",
                   help=f"the drafter family both trainers train ({', '.join(METHODS)}; the others are refused)")
    dflash = p.add_argument_group("--method dflash (both trainers)")
    dflash.add_argument("--block-size", type=int, default=8, help="B: the anchor and B-1 drafts")
    dflash.add_argument("--anchors", type=int, default=32, help="blocks per row per step")
    dflash.add_argument("--gamma", type=float, default=4.0, help="--loss ce: the slot decay")
    dflash.add_argument("--loss", choices=sorted(DFLASH_OBJECTIVES), default="ce",
                        help="ce: slot k weighted exp(-(k-1)/--gamma) (ModelOpt's decay objective); dpace: D-PACE's "
                             "weights (ModelOpt's default objective; its normaliser differs: see the module doc)")
    known, _ = p.parse_known_args(argv)
    p.set_defaults(settings=["float32:1"] if known.method == "eagle3" else ["bfloat16"])
    args = cs.checked_args(p, argv)
    if args.method in REFUSED:
        p.error(f"--method {args.method}: {REFUSED[args.method]}")
    args.our_arg = sf.match_ours(args) + args.our_arg
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
                  draft_vocab_size: int, eval_samples: int = 16, seed: int = 0, method: str = "eagle3") -> dict:
    """Write our feature store as ModelOpt's offline rows of ``method`` in ``out`` (see the module doc: EAGLE-3's
    answer mask shifted, DFlash's as it is); returns what was written (also ``out/convert.json``; an ``out`` whose
    convert.json matches the store and settings is reused)."""
    import torch

    from specheads.data.store import STORE_DTYPES
    from specheads.models.vocab import build_draft_vocab, count_loss_tokens

    out = Path(out)
    fmt = CONVERT_FORMAT if method == "eagle3" else f"{CONVERT_FORMAT}+{method}"
    store, key, earlier = cs.cached_conversion(features, out, fmt, draft_vocab_size, eval_samples, seed)
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
            mask = modelopt_loss_mask(item["loss_mask"]) if method == "eagle3" else item["loss_mask"].long()
            torch.save({"input_ids": item["input_ids"].long(), "hidden_states": item["hidden_last"].to(dtype),
                        "aux_hidden_states": item["hidden_aux"].to(dtype), "loss_mask": mask},
                       out / split / f"{k:06d}.pt")
            ids[split].append(str(item["id"]))
            lengths.append(item["input_ids"].numel())
    d2t, _ = build_draft_vocab(count_loss_tokens(str(prepared), vocab_size, rows=ids["train"]), draft_vocab_size)
    torch.save(d2t.long(), out / "d2t.pt")  # EAGLE-3's draft vocabulary (DFlash drafts over the whole one)
    info = {**key, "method": method, "train_dir": str(out / "train"), "heldout_dir": str(out / "heldout"),
            "d2t": str(out / "d2t.pt"), "num_train": len(train_idx), "num_heldout": len(eval_idx),
            "ids": ids["train"] + ids["heldout"], "train_tokens": int(sum(lengths[: len(train_idx)])),
            "max_length": max(lengths), "aux_layers": list(store.manifest["aux_layers"]),
            "hidden_dtype": str(dtype).removeprefix("torch.")}
    done.write_text(json.dumps(info))
    return info


# --------------------------------------------------------------------------- ModelOpt's run (a child process)


def train_length(method: str, max_length: int, block_size: int) -> int:
    """L, the length ModelOpt pads every row to: the longest row (EAGLE-3); for DFlash that plus B-1, rounded up to
    a multiple of B (its forward refuses other lengths), so that every row's anchors fit (it anchors at a <= L - B)."""
    if method == "eagle3":
        return max_length
    return -(-(max_length + block_size - 1) // block_size) * block_size


def modelopt_flags(args, dtype: str, ttt: int, data: dict, out: Path) -> dict:
    """The child's settings (one JSON argument)."""
    from specheads.targets import resolve_target_path

    method = cs.method_of(args)
    length = train_length(method, data["max_length"], args.block_size)
    flags = {"method": method, "target": str(resolve_target_path(args.target)), "train_dir": data["train_dir"],
             "heldout_dir": data["heldout_dir"], "out": str(out), "dtype": dtype,
             "aux_ids": [i - 1 for i in data["aux_layers"]], "train_len": length,
             "batch_rows": max(1, args.max_tokens // length), "epochs": args.epochs, "max_steps": args.max_steps,
             "lr": args.lr, "warmup_steps": args.warmup_steps, "seed": args.seed}
    if method == "dflash":
        return {**flags, "block_size": args.block_size, "anchors": args.anchors, "mask_token": args.mask_token,
                "objective": DFLASH_OBJECTIVES[args.loss], "gamma": args.gamma if args.loss == "ce" else 0.0}
    return {**flags, "ttt": ttt, "d2t": data["d2t"], "draft_vocab_size": args.draft_vocab_size}


def _shim_transformers(method: str) -> None:
    """ModelOpt 0.47 on transformers >= 5.13: the renames named in the module doc, patched in this process (EAGLE-3:
    the decoder layer's cache argument and the Llama rotary embedding; DFlash: its draft's Qwen3 rotary embedding)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.13"):
        return
    if method == "dflash":
        import modelopt.torch.speculative.plugins.modeling_dflash as modeling_dflash
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        modeling_dflash._ROTARY_CLS = lambda config, device=None: Qwen3RotaryEmbedding(config=config).to(device)
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


LAYER_KEYS = ("num_hidden_layers", "hidden_act", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "rms_norm_eps", "rope_theta")


def draft_layer(target: str) -> dict:
    """One draft layer of the target's shape (``sf.layer_fields``: heads, kv heads, head size, MLP width, activation,
    norm eps, rope theta), as ModelOpt's architecture configs take it (its defaults are sized for an 8B target)."""
    fields = sf.layer_fields(sf.target_text_config(target))
    return {k: fields[k] for k in LAYER_KEYS}


def convert_eagle3(model, flags: dict) -> None:
    """``model`` -> ModelOpt's offline EAGLE-3 of one layer of the target's shape, with our draft vocabulary."""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.config import eagle3_default_config

    layer = draft_layer(flags["target"])
    rope = {"rope_type": "default", "rope_theta": layer["rope_theta"]}
    arch = {**eagle3_default_config, **layer, "rope_scaling": rope,
            "draft_vocab_size": flags["draft_vocab_size"], "eagle_aux_hidden_state_layer_ids": flags["aux_ids"]}
    mtsp.convert(model, [("eagle", {"eagle_offline": True, "eagle_decoder_type": "llama", "eagle_ttt_steps":
                                    flags["ttt"], "eagle_use_torch_compile": False, "eagle_loss_decay_factor":
                                    LOSS_DECAY, "eagle_export_rope_scaling": {}, "eagle_architecture_config": arch})])
    mtsp.plugins.HFEagleModel.load_draft_vocab_cache(model, flags["d2t"])


def dflash_config(flags: dict) -> dict:
    """ModelOpt's ``dflash`` mode config for the module doc's matched settings."""
    return {"dflash_offline": True, "dflash_block_size": flags["block_size"], "dflash_num_anchors": flags["anchors"],
            "dflash_mask_token_id": flags["mask_token"], "dflash_self_logit_distillation": False,
            "dflash_loss_objective": flags["objective"], "dflash_loss_decay_factor": flags["gamma"],
            "dflash_use_torch_compile": False, "dflash_architecture_config": draft_layer(flags["target"])}


def convert_dflash(model, flags: dict) -> None:
    """``model`` -> ModelOpt's offline DFlash of one layer fed our aux layers (the module doc's one patch)."""
    import modelopt.torch.speculative as mtsp
    import modelopt.torch.speculative.plugins.hf_dflash as hf_dflash

    hf_dflash.build_target_layer_ids = lambda num_target_layers, num_draft_layers: list(flags["aux_ids"])
    mtsp.convert(model, [("dflash", dflash_config(flags))])


def modelopt_child(flags: dict) -> None:
    """Convert the target to ModelOpt's EAGLE-3 or DFlash (offline), train it with HF Trainer, report steps to
    ``out/steps.jsonl`` and held-out figures to ``out/val.json``, export to ``out/export``."""
    import torch
    import transformers

    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.utils import load_vlm_or_llm

    _shim_transformers(flags["method"])
    transformers.set_seed(flags["seed"])
    out = Path(flags["out"])
    model = load_vlm_or_llm(flags["target"], use_offline_training=True, dtype=torch.float32, device_map="cpu")
    (convert_dflash if flags["method"] == "dflash" else convert_eagle3)(model, flags)

    class Rows(OfflineSupervisedDataset):  # the store's dtype on disk, float32 in the model
        def __getitem__(self, i):
            return {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v)
                    for k, v in super().__getitem__(i).items()}

    def rows(folder):
        return Rows(sorted(str(f) for f in Path(folder).glob("*.pt")), answer_only_loss=True)

    collate = EagleOfflineDataCollator(train_len=flags["train_len"])
    train(model, flags, rows(flags["train_dir"]), collate, out)
    model.eval()
    (out / "val.json").write_text(json.dumps(heldout(model, rows(flags["heldout_dir"]), collate, flags)))
    with torch.inference_mode():
        export_speculative_decoding(model, export_dir=str(out / "export"))


def train(model, flags: dict, rows, collate, out: Path) -> None:
    """HF Trainer over ``rows`` at the flags' settings, one JSON line per optimizer step to ``out/steps.jsonl``."""
    import transformers

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
        output_dir=str(out / "trainer"), num_train_epochs=flags["epochs"], max_steps=flags["max_steps"] or -1,
        per_device_train_batch_size=flags["batch_rows"], learning_rate=flags["lr"], warmup_steps=flags["warmup_steps"],
        lr_scheduler_type="cosine", weight_decay=0.0, bf16=flags["dtype"] == "bfloat16", use_cpu=True,
        save_strategy="no", report_to=[], logging_steps=10, remove_unused_columns=False, disable_tqdm=True,
        seed=flags["seed"], dataloader_num_workers=0)
    trainer = Timed(model=model, args=targs, train_dataset=rows, data_collator=collate, callbacks=[StepTimes()])
    trainer.train()
    steps_log.close()


def heldout(model, rows, collate, flags: dict) -> dict:
    """ModelOpt's loss and ``train_acc`` over the held-out rows, weighted by each row's counted tokens. EAGLE-3: step
    0's (its mask from position 1 on); DFlash: every counted slot's, the row's answer tokens weighing it, on one draw
    of anchors from the seed (its offline forward runs in training mode only, without dropout)."""
    import torch

    dflash = flags["method"] == "dflash"
    if dflash:
        model.train()
        torch.manual_seed(flags["seed"])
    total, loss, acc = 0, 0.0, 0.0
    with torch.no_grad():
        for i in range(len(rows)):
            batch = collate([rows[i]])
            n = int(batch["loss_mask"].sum() if dflash else batch["loss_mask"][:, 1:].sum())
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


def their_heldout(args, val: dict | None) -> dict | None:
    """ModelOpt's held-out figures (``heldout``): its loss and ``train_acc``, under its own name (EAGLE-3: step 0's
    top-1 within the draft vocabulary; DFlash: every counted block slot's top-1 together, against the data's tokens)."""
    if not val:
        return None
    return {"loss": val["loss"], "top1_all_slots" if cs.method_of(args) == "dflash" else "full_acc_step0":
            val["acc_step0"]}


def run_modelopt(args, dtype: str, ttt: int, root: Path, data: dict) -> dict:
    out = root / cs.run_folder(args, "theirs", dtype, ttt)
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
            "last_loss": steps[-1]["loss"] if steps else None, "heldout": their_heldout(args, val),
            "head_dir": str(out / "export") if (out / "export" / "config.json").exists() else None}


# --------------------------------------------------------------------------- main


def report(args, root: Path, data: dict | None, results: list[dict]) -> dict:
    """compare_speculators.py's report as a ``trainer_compare`` against the peer ``modelopt``, with its version (and
    DFlash's labels and loss)."""
    out = cs.report(args, root, data, results)
    versions = {k: v for k, v in out["versions"].items() if k != "speculators"}
    site = args.modelopt_site
    dist = next(Path(site).glob("nvidia_modelopt-*.dist-info"), None) if site else None
    versions["modelopt"] = dist.name.removesuffix(".dist-info").split("-")[1] if dist else None
    settings = out["settings"]
    if cs.method_of(args) == "dflash":  # what both train on (ModelOpt: no logit distillation)
        settings = {**settings, "labels": "data", "loss": args.loss, "gamma": args.gamma if args.loss == "ce" else None}
    steps = getattr(args, "max_steps", None)
    return {**out, "kind": "trainer_compare", "peer": "modelopt", "versions": versions, "settings": settings,
            "budget": {"epochs": args.epochs, **({"max_steps": steps} if steps else {})}}


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
    args.mask_token = cs.mask_token(args.target) if args.method != "eagle3" else None
    data = None
    if "theirs" in trainers:
        from transformers import AutoConfig

        from specheads.targets import resolve_target_path

        vocab = AutoConfig.from_pretrained(resolve_target_path(args.target)).vocab_size
        t0 = time.perf_counter()
        folder = root / ("modelopt-data" if args.method == "eagle3" else f"modelopt-data-{args.method}")
        data = convert_store(args.features, args.prepared, folder, vocab, args.draft_vocab_size, args.eval_samples,
                             args.seed, args.method)
        print(f"ModelOpt data: {data['num_train']} training rows ({data['train_tokens']} tokens) + "
              f"{data['num_heldout']} held out, in {folder} ({time.perf_counter() - t0:.0f} s)", flush=True)
    results = cs.train_both(args, settings, trainers, root, data,
                            lambda dtype, ttt: run_modelopt(args, dtype, ttt, root, data))
    cs.finish(args, root, data, results, report)


if __name__ == "__main__":
    main()
