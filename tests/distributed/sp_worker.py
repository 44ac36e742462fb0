"""Run under torchrun by test_sequence_parallel_processes.py: an EAGLE-3, DFlash or P-EAGLE loss on rows split
across the processes.

    torchrun --nproc_per_node N tests/distributed/sp_worker.py OUT_DIR CASE [CASE ...]

CASE is ``name:T:B:steps:dtype:heads:kv_heads:window:offpath:feature[:mrope]`` (``window`` 0 = full attention;
``mrope`` 1: the head rotates by M-RoPE and the batch holds 3-D ``positions``, as a vision-language target's), or
for DFlash ``dflash:name:T:B:block_size:anchors:dtype:heads:kv_heads:loss:labels:lk_weight[:dense]`` (``dense`` 1:
the blocks attend through the dense mask, the path off the CPU, instead of ``ranged_attention``), or for P-EAGLE
``peagle:name:T:B:depths:dtype:heads:kv_heads:layers``. For each
case every rank builds the same tiny EAGLE-3 or DFlash head (hidden 32) and the same random batch of B rows of T
positions (features as a feature store holds them; a padded tail on row 1 when B > 1), wraps the engine's
``TrainingModule`` in DDP over gloo as ``accelerate launch`` does, and runs one forward and backward with each row
split across the N ranks (``train.sequence_parallel=N``): DDP averages the gradients over the ranks. Rank 0 then
computes the same loss in one process (``sequence_parallel`` unset) on the whole rows and writes both, with every
parameter's gradient, to OUT_DIR/<name>.pt.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VOCAB, HIDDEN, DRAFT_VOCAB = 128, 32, 64


def parse(case: str) -> dict:
    if case.startswith("peagle:"):
        _, name, T, B, depths, dtype, heads, kv_heads, layers = case.split(":")
        return {"method": "peagle", "name": name, "T": int(T), "B": int(B), "depths": int(depths),
                "dtype": getattr(torch, dtype), "heads": int(heads), "kv_heads": int(kv_heads), "layers": int(layers),
                "mrope": False}
    if case.startswith("dflash:"):
        _, name, T, B, block, anchors, dtype, heads, kv_heads, loss, labels, lk, *dense = case.split(":")
        return {"method": "dflash", "name": name, "T": int(T), "B": int(B), "block_size": int(block),
                "anchors": int(anchors), "dtype": getattr(torch, dtype), "heads": int(heads),
                "kv_heads": int(kv_heads), "loss": loss, "labels": labels, "lk_weight": float(lk), "mrope": False,
                "dense": bool(int(dense[0])) if dense else False}
    name, T, B, steps, dtype, heads, kv_heads, window, offpath, feature, *mrope = case.split(":")
    return {"name": name, "T": int(T), "B": int(B), "steps": int(steps), "dtype": getattr(torch, dtype),
            "heads": int(heads), "kv_heads": int(kv_heads), "window": int(window) or None, "offpath": float(offpath),
            "feature": float(feature), "mrope": bool(int(mrope[0])) if mrope else False}


def build(case: dict, rank: int = 0):
    """(method, head, target, batch): identical on every rank (fixed seeds), but for the random state DFlash draws
    its anchors from (each rank's own: the group takes rank 0's draw)."""
    from specheads.methods.eagle3 import Eagle3Method
    from tests.conftest import make_tiny_target

    dtype = case["dtype"]
    target = make_tiny_target("llama", vocab=VOCAB, hidden=HIDDEN, layers=3, heads=case["heads"],
                              kv_heads=case["kv_heads"], dtype=dtype)
    if case.get("method") == "dflash":  # 2 draft layers: the second's keys and values come through the first
        from specheads.methods.dflash import DFlashMethod

        method = DFlashMethod(num_layers=2, block_size=case["block_size"], aux_layers=[0, 1, 2],
                              anchors=case["anchors"], loss=case["loss"], labels=case["labels"],
                              lk_weight=case["lk_weight"], mask_token_id=VOCAB - 1)
        torch.manual_seed(1)
        model = method.build(target).to(dtype)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.2)
        torch.manual_seed(4 + rank)  # the anchors' draw: rank 0's in both runs
        return method, model, target, batch(case)
    if case.get("method") == "peagle":
        from specheads.methods.peagle import PEagleMethod

        method = PEagleMethod(num_depths=case["depths"], num_layers=case["layers"], draft_vocab_size=DRAFT_VOCAB,
                              aux_layers=[0, 1, 2], mask_token_id=VOCAB - 1)
    else:
        method = Eagle3Method(draft_vocab_size=DRAFT_VOCAB, aux_layers=[0, 1, 2], ttt_steps=case["steps"],
                              sliding_window=case["window"], offpath_weight=case["offpath"],
                              feature_weight=case["feature"])
    torch.manual_seed(1)
    model = method.make_model(target).to(dtype).attach(target)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if case["mrope"]:  # Qwen3-VL's interleaved M-RoPE over the head's 4 frequencies (head_dim 8)
        from specheads.models.mrope import MRotaryEmbedding

        model.config.rope_parameters = {**model.config.rope_parameters, "mrope_section": [2, 1, 1],
                                        "mrope_interleaved": True}
        model.rotary_emb = MRotaryEmbedding(model.config)
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    model.set_draft_vocab(ids - torch.arange(DRAFT_VOCAB), t2d)
    torch.manual_seed(4 + rank)  # P-EAGLE's draw of its slots: rank 0's in both runs
    return method, model, target, batch(case)


def batch(case: dict) -> dict:
    B, T, dtype = case["B"], case["T"], case["dtype"]
    g = torch.Generator().manual_seed(3)
    attn = torch.ones(B, T, dtype=torch.long)
    if B > 1:
        attn[1, T - T // 3:] = 0  # a padded tail
    loss_mask = (torch.rand(B, T, generator=g) > 0.2).long() * attn
    loss_mask[:, : T // 10] = 0  # a prompt
    out = {"input_ids": torch.randint(0, VOCAB, (B, T), generator=g) * attn, "attention_mask": attn,
           "loss_mask": loss_mask, "hidden_aux": torch.randn(B, T, 3 * HIDDEN, generator=g, dtype=dtype),
           "hidden_last": torch.randn(B, T, HIDDEN, generator=g, dtype=dtype)}
    if case["mrope"]:  # 3-D positions whose axes differ (an image's), zero on padding as a store's collate gives them
        out["positions"] = torch.randint(0, T, (B, T, 3), generator=g) * attn[..., None]
    return out


def run(module, batch: dict) -> tuple[float, dict, dict, float]:
    t0 = time.perf_counter()
    out = module(batch)
    out.loss.backward()
    inner = getattr(module, "module", module).model
    grads = {n: p.grad.detach().clone() for n, p in inner.named_parameters() if p.requires_grad}
    return out.loss.item(), grads, out.metrics, time.perf_counter() - t0


def main(out_dir: str, *cases: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from specheads.methods.base import TrainingModule
    from specheads.training import sequence_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from specheads.models import ranged_attention

    supported = ranged_attention.supported
    for text in cases:
        case = parse(text)
        ranged_attention.supported = (lambda *tensors: False) if case.get("dense") else supported
        method, model, target, rows = build(case, rank)
        shard = sequence_parallel.enable(method, world)
        assert shard is not None and shard.rank == rank
        split = run(DistributedDataParallel(TrainingModule(method, model, target)), rows)
        if rank == 0:
            method, model, target, rows = build(case)  # a fresh head, outside DDP
            whole = run(TrainingModule(method, model, target), rows)
            torch.save({"split": split, "whole": whole, "world": world}, Path(out_dir) / f"{case['name']}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
