"""Where a speculative decoding step's time goes at a real model's shape: draft, target forward, verify, the rest.

    python scripts/bench/bench_evaluate.py                                   # shape:llama-3.2-1b, B 1 8 64, trees 8 24 64
    python scripts/bench/bench_evaluate.py --target shape:llama-3.1-8b --batch 1 8 --nodes 24 --json OUT/eval.json
    python scripts/bench/bench_evaluate.py --target tiny --batch 1 4 --nodes 8 --new-tokens 8     # a CPU smoke

The target is ``shape:NAME`` (random weights of a real configuration made on the device, no download; see
``specheads.targets.shapes``), ``tiny``, or any target ``specheads evaluate`` takes; by default on the GPU when
there is one, in the CLI's dtype (bfloat16 on a GPU). The drafter is an EAGLE-3 head of the target's shape (random
weights, a 32k draft vocabulary) drafting EAGLE-2 dynamic trees of ``--nodes`` nodes: the drafting and verification
work of a real head; acceptance means nothing on random weights, so steps are what they cost, not what they gain.

For each batch size and tree size the same prompts are decoded greedily (``specheads.decoding.generate``, the loop
the evaluator and its batch figures run) once per verification backend:

* ``triton``: the whole batch's decisions in one fused kernel call per step (CUDA only);
* ``torch``: the same decisions in one call of the batched PyTorch reference;
* ``rows``: row by row through the exact reference (``verify_greedy``), what batch-1 evaluation runs;
* ``sequential`` (B > 1): the first ``--sequential-rows`` rows decoded one at a time at batch 1: whether batching
  pays.

and plain decoding (no drafter) once, as the baseline. With ``--temperature T > 0`` every step samples: each row is
verified on its own (the loop verifies sampling steps row by row), by the exact reference walk (``rows``,
``verify_tree_sampling``: a draw per visited node) or by the fused per-row call (``triton`` / ``torch``:
``verify_tree_sampling_fused``, one call a row); the fused backends share their uniforms, so they must decode the
same tokens; the reference draws otherwise (same law, other samples), so its tokens are not compared. Every run waits for the device at each phase's end
(``sync``), so the split charges each phase its own device time. Per run it prints tokens/s, ms per step for draft,
target forward, verify and the rest (committing the cache, feeding the drafter), the target forward's achieved
TFLOP/s and share of the device's peak (``hardware.peak_tflops``; FLOPs from the configuration), and the peak GPU
memory. The backends must produce the same tokens (exit 1 otherwise). ``--json PATH`` writes the report for
``specheads record`` (an ``eval_bench`` entry of ``docs/benchmarks.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import load_bench_target  # noqa: E402  (scripts/bench is not a package)

BACKENDS = ("triton", "torch", "rows")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="shape:llama-3.2-1b", help="shape:NAME, tiny, or a target specheads evaluates")
    p.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda")
    p.add_argument("--dtype", default="auto", help="auto (as the CLI: bfloat16 on a GPU), float32, bfloat16")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="batch sizes")
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 24, 64], help="draft tree nodes per row and step")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS,
                   help="verification backends (triton is skipped without CUDA)")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens of context per row")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per row")
    p.add_argument("--sequential-rows", type=int, default=4,
                   help="rows decoded one at a time for the 'sequential' figure of B > 1 (0: none)")
    p.add_argument("--draft-vocab", type=int, default=32000, help="the EAGLE-3 head's draft vocabulary")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled, verified row by row")
    p.add_argument("--json", default=None, help="write the report here (for specheads record)")
    return p.parse_args(argv)


def tree_shape(nodes: int):
    """An EAGLE-2 dynamic tree of ``nodes`` nodes (depth 6; top-8 expansions past 32 nodes, else top-4)."""
    from specheads.decoding.drafters import TreeShape

    return TreeShape("dynamic", depth=6, topk=8 if nodes > 32 else 4, total_tokens=nodes)


def eagle3_head(target, draft_vocab: int):
    """An EAGLE-3 head of ``target``'s shape with random weights, on its device and in its dtype."""
    from specheads.models.eagle3 import Eagle3Config, Eagle3Model

    config = Eagle3Config.from_target(target, draft_vocab)
    torch.manual_seed(0)
    model = Eagle3Model(config).to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    vd = config.draft_vocab_size
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[:vd] = True
    model.set_draft_vocab(torch.zeros(vd, dtype=torch.long), t2d)
    return model.attach(target)


def prompts_for(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def sampling_verifier(backend: str):
    """A ``verify_fn`` for sampled steps: the exact reference walk (``rows``) or the fused per-row call."""
    from specheads.decoding.batched_verify import verify_tree_sampling_fused
    from specheads.decoding.verify import verify

    if backend == "rows":
        return verify
    return lambda method, logits, tree, T, gen: verify_tree_sampling_fused(logits, tree, T, gen, backend=backend)


def timed_run(runner, drafter, prompts, new_tokens: int, backend: str | None, temperature: float = 0.0) -> dict:
    """One decode of ``prompts`` (after an untimed short one), split by phase: greedy with ``backend`` verifying the
    batch at once (None: row by row), or sampled at ``temperature`` with each row verified by ``backend``'s
    ``sampling_verifier`` (seeded alike for every backend)."""
    from specheads.decoding.generate import speculative_generate

    if temperature > 0:
        fn = sampling_verifier(backend or "rows")
        kw = dict(verify_fn=fn)
        gen = lambda: torch.Generator(runner.device).manual_seed(0)  # noqa: E731
        speculative_generate(runner, drafter, prompts, min(4, new_tokens), temperature, "tree", generator=gen(), **kw)
        res = speculative_generate(runner, drafter, prompts, new_tokens, temperature, "tree", generator=gen(),
                                   sync=True, **kw)
    else:
        speculative_generate(runner, drafter, prompts, min(4, new_tokens), 0.0, "greedy", verify_backend=backend)
        res = speculative_generate(runner, drafter, prompts, new_tokens, 0.0, "greedy", verify_backend=backend,
                                   sync=True)
    decode = res.wall_time - res.prefill_time
    steps = len(res.batch_forward_sizes)
    return {"tokens": res.tokens, "steps": steps, "decode_s": decode, "target_s": res.target_time,
            "draft_s": res.draft_time, "verify_s": res.verify_time, "fed_tokens": sum(res.batch_forward_sizes),
            "emitted": sum(map(len, res.tokens))}


def sequential_run(runner, drafter, prompts, new_tokens: int, temperature: float = 0.0) -> dict:
    """Each row alone at batch 1 (row-by-row verification, as batch-1 evaluation runs); the rows' sums."""
    runs = [timed_run(runner, drafter, [p], new_tokens, None, temperature) for p in prompts]
    out = {k: sum(r[k] for r in runs) for k in ("steps", "decode_s", "target_s", "draft_s", "verify_s",
                                               "fed_tokens", "emitted")}
    out["tokens"] = [r["tokens"][0] for r in runs]
    return out


def row_figures(run: dict, flops_per_token: float, peak: float | None) -> dict:
    steps = max(run["steps"], 1)
    rest = max(run["decode_s"] - run["target_s"] - run["draft_s"] - run["verify_s"], 0.0)
    tflops = flops_per_token * run["fed_tokens"] / run["target_s"] / 1e12 if run["target_s"] > 0 else None
    return {"steps": run["steps"], "emitted": run["emitted"], "tokens_per_s": run["emitted"] / run["decode_s"],
            "ms_per_step": 1e3 * run["decode_s"] / steps, "draft_ms": 1e3 * run["draft_s"] / steps,
            "forward_ms": 1e3 * run["target_s"] / steps, "verify_ms": 1e3 * run["verify_s"] / steps,
            "rest_ms": 1e3 * rest / steps, "verify_share": run["verify_s"] / run["decode_s"],
            "fed_per_step": run["fed_tokens"] / steps, "forward_tflops": tflops,
            "forward_share_of_peak": tflops / peak if (tflops and peak) else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    from specheads.decoding.cpu_linears import choose_cpu_linears
    from specheads.decoding.head_drafters import EagleDrafter
    from specheads.decoding.runner import TargetRunner
    from specheads.hardware import cpu_description, peak_tflops
    from specheads.targets.shapes import forward_flops_per_token

    target = load_bench_target(args.target, args.device, args.dtype)
    cuda = target.device.type == "cuda"
    device = torch.cuda.get_device_name(target.device) if cuda else cpu_description()
    if not cuda:
        choose_cpu_linears(target.model, "auto")
    backends = [b for b in args.backends if b != "triton" or cuda]
    dtype = str(target.dtype).removeprefix("torch.")
    peak = peak_tflops(device, dtype) if cuda else None
    config = target.config
    flops = forward_flops_per_token(config, context=args.prompt_len + args.new_tokens // 2)
    runner = TargetRunner(target.model)
    head = eagle3_head(target, args.draft_vocab)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    T = args.temperature
    print(f"# {args.target} ({dtype}) on {device}; EAGLE-3 head with random weights; {args.prompt_len} tokens of "
          f"context, {args.new_tokens} new per row; T = {T}; phases timed with a device wait at each end", flush=True)
    print(f"{'B':>3} {'nodes':>5} {'verify':>10} {'tok/s':>9} {'ms/step':>8} {'draft':>7} {'forward':>8} "
          f"{'verify':>7} {'rest':>7} {'verify%':>7} {'TFLOP/s':>8} {'of peak':>7}", flush=True)
    rows, mismatches = [], []

    def show(B, nodes, backend, run):
        r = {"batch": B, "nodes": nodes, "backend": backend, **row_figures(run, flops, peak)}
        rows.append(r)
        tf = f"{r['forward_tflops']:.1f}" if r["forward_tflops"] is not None else "-"
        share = f"{100 * r['forward_share_of_peak']:.0f}%" if r["forward_share_of_peak"] is not None else "-"
        print(f"{B:>3} {nodes:>5} {backend:>10} {r['tokens_per_s']:>9.1f} {r['ms_per_step']:>8.2f} "
              f"{r['draft_ms']:>7.2f} {r['forward_ms']:>8.2f} {r['verify_ms']:>7.2f} {r['rest_ms']:>7.2f} "
              f"{100 * r['verify_share']:>6.1f}% {tf:>8} {share:>7}", flush=True)

    for B in args.batch:
        prompts = prompts_for(B, args.prompt_len, config.vocab_size, seed=B)
        show(B, 0, "plain", timed_run(runner, None, prompts, args.new_tokens, "rows" if T > 0 else "auto", T))
        for nodes in args.nodes:
            drafter = EagleDrafter(head, tree_shape(nodes), "eagle3")
            tokens = {}
            for backend in backends:
                run = timed_run(runner, drafter, prompts, args.new_tokens, None if backend == "rows" else backend, T)
                tokens[backend] = run["tokens"]
                show(B, nodes, backend, run)
            if B > 1 and args.sequential_rows > 0:
                k = min(B, args.sequential_rows)
                run = sequential_run(runner, drafter, prompts[:k], args.new_tokens, T)
                if T <= 0:  # sampled rows draw from another stream alone than in a batch: not compared
                    tokens["sequential"] = run["tokens"] + tokens[backends[0]][k:]
                show(B, nodes, "sequential", run)
            if T > 0:  # the reference walk draws otherwise (same law): only the fused backends must agree
                tokens.pop("rows", None)
            first = next(iter(tokens.values()), None)
            for name, toks in tokens.items():
                if toks != first:
                    mismatches.append(f"B={B} nodes={nodes}: {name} decoded other tokens than {next(iter(tokens))}")
    peak_mib = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    for m in mismatches:
        print("MISMATCH " + m)
    report = {"kind": "eval_bench", "target": args.target, "target_dtype": dtype, "machine": device, "temperature": T,
              "device": "cuda" if cuda else "cpu", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "drafter": f"eagle3 (random weights, draft vocabulary {args.draft_vocab})",
              "peak_tflops": peak, "peak_gpu_mib": peak_mib, "rows": rows, "mismatches": mismatches,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"report in {args.json}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
