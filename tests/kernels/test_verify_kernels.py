"""Batched verification: references vs verify.py's per-tree functions, Triton kernels vs references.

Without CUDA the kernels run on CPU tensors in the Triton interpreter (TRITON_INTERPRET=1 is set
here before the kernel modules are imported); with CUDA they run compiled on the GPU, and the
``gpu`` tests add SGLang-sized vocabularies.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specheads.decoding import verify as verify_mod  # noqa: E402
from specheads.decoding.batched_verify import (PAD, inverse_cdf, pack_trees, to_verdicts,  # noqa: E402
                                               verify_greedy_batched, verify_greedy_reference,
                                               verify_greedy_fused, verify_tree_sampling_batched,
                                               verify_tree_sampling_fused,
                                               verify_tree_sampling_reference)
from specheads.decoding.tree import DraftTree  # noqa: E402
from specheads.kernels import INSTALL_HINT, require_triton, triton_available  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason=f"Triton not installed: {INSTALL_HINT}")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (dtype, chunk): chunk 16 (256 for V = 1000) splits rows into 3-4 chunks; the interpreter runs each
# program in Python, so the split runs on two dtypes only
DTYPE_CHUNK = [(d, 4096) for d in DTYPES] + [(torch.float32, 16), (torch.bfloat16, 16)]


# ------------------------------------------------------------------ random batches

def random_tree(rng: random.Random, n: int, V: int, best: list[int], shape: str) -> DraftTree:
    """n nodes; chain, bushy (wide, shallow) or mixed; distinct siblings; a node's token is often
    ``best[parent + 1]`` (the target's favourite after its parent) so paths get accepted."""
    toks, pars, used = [], [], {}
    for i in range(n):
        if shape == "chain":
            p = i - 1
        elif shape == "bushy":
            p = rng.choice([-1] + list(range(min(i, 3))))
        else:
            p = rng.randrange(-1, i)
        taken = used.setdefault(p, set())
        t = best[p + 1] if rng.random() < 0.6 else rng.randrange(V)
        while t in taken:
            t = rng.randrange(V)
        taken.add(t)
        toks.append(t); pars.append(p)
    return DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long))


def random_batch(seed: int, B: int, n: int, V: int, ties: bool = False):
    """-> logits (B, n+1, V) float32, tokens, parents (B, n) (trees of up to n nodes), trees."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(-2, 3, (B, n + 1, V), generator=g).float() if ties
              else 2 * torch.randn(B, n + 1, V, generator=g))
    if not ties:  # peaky rows, so that sampled walks also go deep
        logits.scatter_add_(2, logits.argmax(-1, keepdim=True), torch.full((B, n + 1, 1), 4.0))
    trees = []
    for b in range(B):
        size = n if b % 3 == 0 else rng.randint(0, n)
        best = logits[b].argmax(-1).tolist()
        trees.append(random_tree(rng, size, V, best, ["chain", "bushy", "mixed"][b % 3]))
    tokens, parents = pack_trees(trees, n)
    return logits, tokens, parents, trees


def draws_from(u: torch.Tensor):
    """A stand-in for verify.py's ``_draw`` taking inverse-CDF draws from the uniforms u in order."""
    it = iter(u.tolist())

    def _draw(p, generator=None):
        return int(inverse_cdf(p[None].double(), torch.tensor([next(it)], dtype=torch.float64))[0])
    return _draw


# ------------------------------------------------------------------ references vs verify.py

@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ties", [False, True])
def test_greedy_reference_equals_verify_greedy(seed, ties):
    n = [1, 7, 13, 24, 5, 31][seed]
    logits, tokens, parents, trees = random_batch(seed, 9, n, [37, 1000][seed % 2], ties)
    out = verify_greedy_reference(logits, tokens, parents)
    got = to_verdicts(*out, parents)
    for b, tree in enumerate(trees):
        assert got[b] == verify_mod.verify_greedy(logits[b, :tree.size + 1], tree), (seed, b)
    assert out[0].sum() > 0  # the batch does accept something


def test_greedy_ties_pick_lowest_id():
    logits = torch.zeros(1, 3, 8)
    logits[0, 0, [2, 5]] = 1.0  # tie between ids 2 and 5 after the root
    tokens, parents = torch.tensor([[5, 2]]), torch.tensor([[-1, -1]])
    acc, path, bonus = verify_greedy_reference(logits, tokens, parents)
    assert acc.tolist() == [1] and path.tolist() == [[1, -1]] and bonus.tolist() == [0]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_sampling_reference_equals_verify_tree_sampling(seed, temperature, monkeypatch):
    n = [1, 6, 11, 20, 3, 29][seed]
    logits, tokens, parents, trees = random_batch(100 + seed, 8, n, [37, 1000][seed % 2])
    u = torch.rand(8, n + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    out = verify_tree_sampling_reference(logits, tokens, parents, temperature, u)
    got = to_verdicts(*out, parents)
    for b, tree in enumerate(trees):
        monkeypatch.setattr(verify_mod, "_draw", draws_from(u[b]))
        assert got[b] == verify_mod.verify_tree_sampling(logits[b, :tree.size + 1], tree, temperature), (seed, b)
    assert out[0].sum() > 0 and (out[0] < (parents != PAD).sum(1)).any()  # accepts and rejects


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_per_tree_wrappers_keep_verify_signatures(backend, monkeypatch):
    logits, _, _, trees = random_batch(11, 6, 9, 37)
    for b, tree in enumerate(trees):
        row = logits[b, :tree.size + 1]
        assert verify_greedy_fused(row.to(DEV), tree, backend) == verify_mod.verify_greedy(row, tree)
        got = verify_tree_sampling_fused(row.to(DEV), tree, 0.9, torch.Generator().manual_seed(b), backend)
        monkeypatch.setattr(verify_mod, "_draw", draws_from(
            torch.rand(1, tree.size + 1, generator=torch.Generator().manual_seed(b), dtype=torch.float64)[0]))
        assert got == verify_mod.verify_tree_sampling(row, tree, 0.9)


def test_sampling_at_temperature_zero_is_greedy():
    logits, tokens, parents, _ = random_batch(7, 5, 9, 37)
    greedy = verify_greedy_batched(logits, tokens, parents, backend="torch")
    sampled = verify_tree_sampling_batched(logits, tokens, parents, 0.0, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(greedy, sampled))


def test_sampling_first_draw_follows_the_target():
    """With no tree, the bonus is one draw from softmax(logits / T): check its frequencies."""
    logits = torch.tensor([[[1.0, 0.0, -1.0, 2.0]]]).expand(4000, 1, 4).contiguous()
    empty = torch.zeros(4000, 0, dtype=torch.long)
    _, _, bonus = verify_tree_sampling_batched(logits, empty, empty, 0.8, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(bonus, minlength=4).double() / 4000
    p = torch.softmax(logits[0, 0].double() / 0.8, -1)
    assert (freq - p).abs().max() < 4 * (0.25 / 4000) ** 0.5  # 4 sigma of a binomial proportion


def test_sampling_walk_is_lossless_for_the_first_token():
    """Accepted child or bonus, the first emitted token follows the target's root row exactly."""
    B, V, T = 6000, 5, 1.3
    logits = torch.tensor([[0.5, -0.2, 1.0, 0.0, 0.3]] * 4).expand(B, 4, V).contiguous()
    tokens = torch.tensor([[0, 3, 1]]).expand(B, 3)
    parents = torch.tensor([[-1, -1, 0]]).expand(B, 3)
    acc, path, bonus = verify_tree_sampling_batched(logits, tokens, parents, T,
                                                    generator=torch.Generator().manual_seed(5))
    first = torch.where(acc > 0, tokens.gather(1, path[:, :1].clamp(min=0)).squeeze(1), bonus)
    freq = torch.bincount(first, minlength=V).double() / B
    p = torch.softmax(logits[0, 0].double() / T, -1)
    assert (freq - p).abs().max() < 4 * (0.25 / B) ** 0.5
    assert 0 < (acc > 0).double().mean() < 1


# ------------------------------------------------------------------ bad input

def test_bad_shapes_and_values_are_named():
    logits, tokens, parents, _ = random_batch(0, 2, 4, 37)
    with pytest.raises(ValueError, match=r"logits \(2, 5\) must be \(B, n\+1, V\)"):
        verify_greedy_batched(logits[:, :, 0], tokens, parents)
    with pytest.raises(ValueError, match="need tokens/parents of shape"):
        verify_greedy_batched(logits[:, :4], tokens, parents)
    with pytest.raises(ValueError, match=r"must both be \(B, n\)"):
        verify_greedy_batched(logits, tokens, parents[:, :3])
    bad = parents.clone(); bad[1, 2] = 2
    with pytest.raises(ValueError, match=r"parents\[1, 2\] = 2 must be -1"):
        verify_greedy_batched(logits, tokens, bad)
    bad = tokens.clone(); bad[0, 3] = 37
    with pytest.raises(ValueError, match=r"tokens\[0, 3\] = 37 is outside \[0, 37\)"):
        verify_tree_sampling_batched(logits, bad, parents, 1.0)
    with pytest.raises(ValueError, match=r"uniforms \(2, 4\) must be \(B, n\+1\)"):
        verify_tree_sampling_batched(logits, tokens, parents, 1.0, torch.rand(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown verification backend 'cuda'"):
        verify_greedy_batched(logits, tokens, parents, backend="cuda")


def test_missing_triton_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ImportError, match="pip install triton"):
        require_triton()


@needs_triton
def test_kernels_refuse_cpu_tensors_outside_the_interpreter(monkeypatch):
    from specheads.kernels.verify_greedy import verify_greedy_triton
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    logits, tokens, parents, _ = random_batch(0, 2, 4, 37)
    with pytest.raises(RuntimeError, match="need CUDA tensors"):
        verify_greedy_triton(logits, tokens, parents)


# ------------------------------------------------------------------ kernels vs references

def _same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.cpu(), y.cpu(), rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype,chunk", DTYPE_CHUNK)
@pytest.mark.parametrize("V,n,ties", [(37, 7, True), (1000, 13, False), (37, 0, False), (1000, 1, True)])
def test_greedy_kernel_equals_reference(dtype, V, n, ties, chunk):
    """Small chunks split each row (3 or 4 chunks), so ties straddle chunk boundaries."""
    chunk = 256 if chunk == 16 and V > 100 else chunk  # the interpreter runs each program in Python
    from specheads.kernels.verify_greedy import verify_greedy_triton
    logits, tokens, parents, _ = random_batch(V + n, 7, n, V, ties)
    logits = logits.to(dtype)  # the reference sees the same rounded logits
    args = (logits.to(DEV), tokens.to(DEV), parents.to(DEV))
    ref = verify_greedy_reference(*args)
    _same(verify_greedy_triton(*args, chunk=chunk), ref)
    if chunk == 4096:
        _same(verify_greedy_batched(*args, backend="triton"), ref)


@needs_triton
@pytest.mark.parametrize("dtype,chunk", DTYPE_CHUNK)
@pytest.mark.parametrize("V,n,T", [(37, 7, 1.0), (1000, 13, 0.7), (37, 0, 1.3), (1000, 3, 2.0)])
def test_sampling_kernel_equals_reference(dtype, V, n, T, chunk):
    """Small chunks (3 or 4 per row) exercise the chunk search; 4096 scans whole rows."""
    from specheads.kernels.tree_sampling import verify_tree_sampling_triton
    chunk = 256 if chunk == 16 and V > 100 else chunk
    logits, tokens, parents, _ = random_batch(V + n + 1, 6, n, V)
    u = torch.rand(6, n + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    args = (logits.to(dtype).to(DEV), tokens.to(DEV), parents.to(DEV), T, u.to(DEV))
    ref = verify_tree_sampling_reference(*args)
    _same(verify_tree_sampling_triton(*args, chunk=chunk), ref)
    if chunk == 4096:
        _same(verify_tree_sampling_batched(*args, backend="triton"), ref)


@needs_triton
def test_sampling_kernel_residual_and_zero_weights():
    """Rejections everywhere (children carry no mass) and -inf logits (ids that must never come out)."""
    V, n = 37, 5
    logits = torch.randn(4, n + 1, V, generator=torch.Generator().manual_seed(3))
    logits[:, :, 20:] = float("-inf")
    tokens = torch.tensor([[25, 26, 27, 28, 29]] * 4)
    parents = torch.tensor([[-1, -1, 0, 1, -1], [-1, 0, 1, 2, 3], [-1, -1, -1, -1, -1], [-1, 0, 0, 0, PAD]])
    u = torch.rand(4, n + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    u[0, 1] = 0.0
    args = (logits.to(DEV), tokens.to(DEV), parents.to(DEV), 1.0, u.to(DEV))
    ref = verify_tree_sampling_reference(*args)
    assert ref[0].tolist() == [0] * 4 and (ref[2] < 20).all()
    _same(verify_tree_sampling_batched(*args, backend="triton"), ref)
    from specheads.kernels.tree_sampling import verify_tree_sampling_triton
    _same(verify_tree_sampling_triton(*args, chunk=16), ref)  # an all -inf chunk (ids 32..36)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_stats_kernel_floats(dtype):
    from specheads.kernels.tree_sampling import chunk_stats
    z = (3 * torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))).to(dtype).to(DEV)
    m, s = chunk_stats(z, 0.7, chunk=256)
    ref = (z.double() / 0.7).reshape(5, 1, 1000)
    ref = torch.nn.functional.pad(ref, (0, 24), value=float("-inf")).reshape(5, 4, 256)
    torch.testing.assert_close(m, ref.max(-1).values, rtol=0, atol=0)
    torch.testing.assert_close(m + s.log(), ref.logsumexp(-1), rtol=1e-12, atol=1e-12)


COMPILE_SM90 = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from specheads.kernels import tree_sampling as ts, verify_greedy as vg
ptrs = {a: "*i64" for a in ("tokens_ptr", "parents_ptr", "accept_ptr", "path_ptr", "bonus_ptr")}
ptrs.update({a: "*fp64" for a in ("temp_ptr", "max_ptr", "sum_ptr", "u_ptr")})
ptrs.update(pval_ptr="*fp32", pidx_ptr="*i32")
jobs = [(vg._split_argmax, {"logits_ptr": "*bf16"}, {"CHUNK": 4096, "BLOCK": 1024}),
        (vg._greedy_walk, {}, {"NPAD": 64, "SPAD": 32}),
        (ts._chunk_stats, {"logits_ptr": "*fp16"}, {"CHUNK": 4096, "BLOCK": 1024}),
        (ts._tree_walk, {"logits_ptr": "*bf16"},
         {"NPAD": 64, "SPAD": 32, "CHUNK": 4096, "BLOCK": 1024, "BLOCK_R": 128})]
for fn, sig, const in jobs:
    full = {a: sig.get(a) or ptrs.get(a) or ("constexpr" if a in const else "i32")
            for a in fn.arg_names}
    out = compile(ASTSource(fn, full, const), target=GPUTarget("cuda", 90, 32))
    assert len(out.asm["cubin"]) > 0
    print("compiled", fn.__name__)
"""


@pytest.mark.slow  # ~12 s: a fresh interpreter plus LLVM and ptxas
@needs_triton
def test_kernels_compile_for_sm90():
    """Lower every kernel to a Hopper cubin with Triton's own toolchain, no GPU needed: catches what
    the interpreter accepts but the compiler rejects. Runs in a fresh process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-c", COMPILE_SM90], env=env, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("compiled") == 4


# ------------------------------------------------------------------ on a GPU, SGLang-sized

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@needs_triton
@pytest.mark.parametrize("V", [49152, 128256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_kernels_equal_references_large_vocab(V, dtype):
    for B, n in [(1, 8), (8, 24), (32, 64)]:
        logits, tokens, parents, _ = random_batch(B + n, B, n, V)
        logits = logits.to(dtype).cuda()
        args = (logits, tokens.cuda(), parents.cuda())
        _same(verify_greedy_batched(*args, backend="triton"), verify_greedy_reference(*args))
        u = torch.rand(B, n + 1, dtype=torch.float64, device="cuda")
        _same(verify_tree_sampling_batched(*args, 1.0, u, backend="triton"),
              verify_tree_sampling_reference(*args, 1.0, u))
