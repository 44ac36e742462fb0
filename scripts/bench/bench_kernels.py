"""Time batched tree verification: PyTorch reference vs Triton kernel, on SGLang-like shapes.

    python scripts/bench/bench_kernels.py                       # B in {1, 8, 32}, n in {8, 24, 64}, V in {128256, 49152}
    python scripts/bench/bench_kernels.py --B 1 8 --n 8 24 --V 49152 --iters 5

On CUDA it times both backends (and checks that they agree exactly); on CPU it times the reference
only and says that the kernel needs CUDA. Trees are random (each node's parent is any earlier node
or the root), and a node's token is the target's argmax after its parent with probability
--hit, so walks go as deep as they do in practice.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from specheads.decoding.batched_verify import verify_greedy_batched, verify_tree_sampling_batched

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_batch(B: int, n: int, V: int, dtype: torch.dtype, device: str, hit: float, seed: int = 0):
    """-> logits (B, n+1, V), tokens (B, n), parents (B, n): random trees, peaky target rows."""
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(B, n + 1, V, generator=g)
    logits.scatter_add_(2, logits.argmax(-1, keepdim=True), torch.full((B, n + 1, 1), 6.0))
    best = logits.argmax(-1).tolist()
    rng = random.Random(seed)
    tokens = torch.zeros(B, n, dtype=torch.long)
    parents = torch.zeros(B, n, dtype=torch.long)
    for b in range(B):
        used: dict[int, set[int]] = {}
        for i in range(n):
            p = rng.randrange(-1, i)
            t = best[b][p + 1] if rng.random() < hit else rng.randrange(V)
            while t in used.setdefault(p, set()):
                t = rng.randrange(V)
            used[p].add(t)
            tokens[b, i], parents[b, i] = t, p
    return logits.to(dtype).to(device), tokens.to(device), parents.to(device)


def timed(fn, iters: int, warmup: int, cuda: bool) -> tuple[float, tuple]:
    """-> (median ms per call, last output)."""
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2], out


def bench_one(args, B: int, n: int, V: int, cuda: bool) -> list[str]:
    dev = "cuda" if cuda else "cpu"
    logits, tokens, parents = make_batch(B, n, V, DTYPES[args.dtype], dev, args.hit)
    u = torch.rand(B, n + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dev)
    calls = {
        "greedy": lambda be: verify_greedy_batched(logits, tokens, parents, backend=be, check=False),
        "sampling": lambda be: verify_tree_sampling_batched(logits, tokens, parents, args.temperature, u,
                                                            backend=be, check=False),
    }
    rows = []
    for name, call in calls.items():
        ref_ms, ref = timed(lambda: call("torch"), args.iters, args.warmup, cuda)
        mean_acc = ref[0].double().mean().item()
        if cuda:
            ker_ms, ker = timed(lambda: call("triton"), args.iters, args.warmup, cuda)
            same = all(torch.equal(a, b) for a, b in zip(ref, ker))
            rows.append(f"{B:>3} {n:>3} {V:>7} {name:>9} {mean_acc:>8.2f} {ref_ms:>10.3f} {ker_ms:>10.3f} "
                        f"{ref_ms / ker_ms:>8.1f}x {'yes' if same else 'NO':>6}")
        else:
            rows.append(f"{B:>3} {n:>3} {V:>7} {name:>9} {mean_acc:>8.2f} {ref_ms:>10.3f} {'needs CUDA':>10}")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (trees)")
    ap.add_argument("--n", type=int, nargs="+", default=[8, 24, 64], help="draft nodes per tree")
    ap.add_argument("--V", type=int, nargs="+", default=[128256, 49152], help="vocabulary sizes")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="logits dtype")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    ap.add_argument("--hit", type=float, default=0.6, help="chance a node's token is the target's argmax")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per case (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls first (Triton compiles here)")
    ap.add_argument("--cpu", action="store_true", help="stay on CPU even when CUDA is there")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    where = torch.cuda.get_device_name() if cuda else "CPU (the Triton kernels need CUDA: reference only)"
    print(f"# device: {where}; logits {args.dtype}; T = {args.temperature}; median of {args.iters} calls")
    print("  B   n       V    method  mean_acc  torch_ms  triton_ms  speedup  equal")
    for V in args.V:
        for B in args.B:
            for n in args.n:
                for row in bench_one(args, B, n, V, cuda):
                    print(row, flush=True)


if __name__ == "__main__":
    main()
