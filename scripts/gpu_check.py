"""The GPU side of the instrument, in one run: the fused Triton verification kernels against the
PyTorch references, and the evaluator end to end with kernels on vs off.

    python scripts/gpu_check.py                  # on one CUDA GPU (a few minutes); see gpu_check.sh
    python scripts/gpu_check.py --cpu-smoke      # no GPU: tiny shapes, kernels in the Triton interpreter

Sections (each adds rows to one figures table; any mismatch makes the exit status 1):

1. imports: ``specheads.decoding``, ``specheads.kernels``, ``specheads.evaluation.suite`` and the
   Medusa method import in a fresh interpreter without pulling datasets, Hydra/OmegaConf or DeepSpeed
   (the GPU box has none of them).
2. decisions: ``verify_greedy_triton`` and ``verify_tree_sampling_triton`` (through the batched
   dispatcher) give exactly the references' (accept_len, path, bonus) on realistic shapes:
   vocabulary 32000 and 128256, trees of 8-64 nodes (chains, bushy and mixed, padded), batch 1-64,
   bf16 and fp32 logits, T = 0 and sampling at T = 1.0 / 0.6 with shared uniforms.
3. timing: median milliseconds per call, reference vs kernel, on the same batches.
4. end to end: ``specheads.evaluation.suite.evaluate`` on a tiny random (peaky) Llama with a noisy
   draft model (chain and dynamic tree), a Medusa head (static tree from its ``medusa_tree.json``)
   and the n-gram baseline, run twice: kernels on (``auto`` picks Triton on CUDA) and off
   (Triton reported unavailable, so ``auto`` picks the batched reference). Every decode call must
   give the same tokens and the same per-depth tested/accepted counts, the reports the same α and τ,
   the kernels must really have run (call count), and the lossless checks must hold. Plus the engine
   at batch 64 with ``verify_backend`` triton / torch / None (row by row): same tokens, same counts.
5. memory: ``Target.release_layers`` (training from a feature store) gives the allocator back at least the
   decoder layers' bytes (``torch.cuda.memory_allocated``), and ``layers_loaded`` the same logits again.

Exit status: 0 all checks ran and matched; 1 a mismatch (or a crash in a check); 3 nothing
mismatched but a section could not run (e.g. transformers missing), so the check is incomplete.
``--out DIR`` also writes ``DIR/gpu_check.json`` (every figure) and ``DIR/gpu_check.md`` (the table).

This file doubles as a pytest plugin (``-p gpu_check`` with ``scripts/`` on the path): importing it
makes ``specheads.kernels`` importable from the repository's ``kernels/`` folder when specheads is
not installed (the folder ships as ``specheads.kernels`` only through the package build).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("datasets", "hydra", "omegaconf", "deepspeed")


def install_kernels_alias() -> str:
    """Make ``specheads.kernels`` importable; returns where it comes from."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if "specheads.kernels" in sys.modules:
        return "already imported"
    try:
        if importlib.util.find_spec("specheads.kernels") is not None:
            return "installed package"
    except ModuleNotFoundError:
        pass
    spec = importlib.util.spec_from_file_location("specheads.kernels", ROOT / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["specheads.kernels"] = module
    spec.loader.exec_module(module)
    import specheads

    specheads.kernels = module
    return f"alias of {ROOT / 'kernels'}"


KERNELS_FROM = install_kernels_alias()  # at import, so it also works as a pytest plugin (-p gpu_check)


# ------------------------------------------------------------------ the figures table


class Table:
    """Rows of (section, case, figures, status); status 'ok', 'MISMATCH', 'ERROR' or 'skipped'."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, section: str, case: str, status: str = "ok", **figures) -> None:
        self.rows.append({"section": section, "case": case, "status": status, **figures})
        fig = "  ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
        print(f"[{section}] {case}: {status}  {fig}", flush=True)

    def failed(self) -> bool:
        return any(r["status"] in ("MISMATCH", "ERROR") for r in self.rows)

    def incomplete(self) -> bool:
        return any(r["status"] == "skipped" for r in self.rows)

    def markdown(self) -> str:
        lines = ["| section | case | status | figures |", "|---|---|---|---|"]
        for r in self.rows:
            fig = ", ".join(f"{k} {_fmt(v)}" for k, v in r.items() if k not in ("section", "case", "status"))
            lines.append(f"| {r['section']} | {r['case']} | {r['status']} | {fig} |")
        return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


# ------------------------------------------------------------------ 1. imports


def check_imports(table: Table, smoke: bool) -> None:
    """A fresh interpreter imports the decoding, kernels and evaluation modules without the heavy deps."""
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
        "import gpu_check\n"
        "import specheads.decoding.batched_verify, specheads.decoding.generate, specheads.decoding.runner\n"
        "import specheads.kernels, specheads.kernels.verify_greedy, specheads.kernels.tree_sampling\n"
        "import specheads.evaluation.suite, specheads.methods.medusa\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if smoke else {}))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if res.returncode != 0:
        table.add("imports", "decoding+kernels+evaluation", "ERROR", error=res.stderr.strip().splitlines()[-1:])
        return
    heavy = json.loads(res.stdout.strip().splitlines()[-1])
    table.add("imports", "decoding+kernels+evaluation", "MISMATCH" if heavy else "ok",
              heavy_modules_pulled=",".join(heavy) or "none")


# ------------------------------------------------------------------ 2-3. kernels vs references


def make_batch(B: int, n: int, V: int, dtype, device: str, seed: int, hit: float = 0.7):
    """Random trees over peaky logits: (logits (B, n+1, V) dtype, tokens, parents (B, n) padded)."""
    import torch

    from specheads.decoding.batched_verify import pack_trees
    from specheads.decoding.tree import DraftTree

    g = torch.Generator(device=device).manual_seed(seed)
    logits = 2 * torch.randn(B, n + 1, V, generator=g, device=device)
    logits.scatter_add_(2, logits.argmax(-1, keepdim=True), torch.full((B, n + 1, 1), 4.0, device=device))
    logits = logits.to(dtype)
    best = logits.argmax(-1).cpu().tolist()  # after rounding to dtype
    rng = random.Random(seed)
    trees = []
    for b in range(B):
        size = n if b % 3 == 0 else rng.randint(0, n)
        kind = ("chain", "bushy", "mixed")[b % 3]
        toks, pars, used = [], [], {}
        for i in range(size):
            p = i - 1 if kind == "chain" else rng.choice([-1] + list(range(min(i, 3)))) if kind == "bushy" \
                else rng.randrange(-1, i)
            taken = used.setdefault(p, set())
            t = best[b][p + 1] if rng.random() < hit else rng.randrange(V)
            while t in taken:
                t = rng.randrange(V)
            taken.add(t)
            toks.append(t); pars.append(p)
        trees.append(DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long)))
    tokens, parents = pack_trees(trees, n)
    return logits, tokens.to(device), parents.to(device)


def _rows_differ(a, b) -> int:
    """Trees whose (accept_len, path, bonus) differ between two results."""
    acc = (a[0] != b[0]) | (a[1] != b[1]).any(1) | (a[2] != b[2])
    return int(acc.sum())


def _timed(fn, iters: int, cuda: bool) -> float:
    """Median ms per call after one untimed call (compilation, allocations)."""
    import torch

    fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def check_kernels(table: Table, smoke: bool, cuda: bool, deadline: float) -> None:
    import torch

    from specheads.decoding.batched_verify import (verify_greedy_batched, verify_greedy_reference,
                                                   verify_tree_sampling_batched, verify_tree_sampling_reference)

    device = "cuda" if cuda else "cpu"
    if smoke:
        vocabs, shapes, dtypes, iters = (97, 300), ((1, 8), (3, 12)), (torch.float32,), 1
    else:
        vocabs = (32000, 128256)
        shapes = ((1, 8), (1, 64), (8, 24), (16, 32), (64, 8), (64, 64))
        dtypes, iters = (torch.bfloat16, torch.float32), 10
    seed = 0
    for V in vocabs:
        for B, n in shapes:
            for dtype in dtypes:
                seed += 1
                case = f"V={V} B={B} n={n} {str(dtype).replace('torch.', '')}"
                try:
                    logits, tokens, parents = make_batch(B, n, V, dtype, device, seed)
                    args = (logits, tokens, parents)
                    ref = verify_greedy_reference(*args)
                    ker = verify_greedy_batched(*args, backend="triton")
                    bad = _rows_differ(ref, ker)
                    figs = {"trees_differ": bad, "mean_accept": float(ref[0].double().mean())}
                    if time.perf_counter() < deadline:
                        r_ms = _timed(lambda: verify_greedy_reference(*args), max(1, iters // 2), cuda)
                        k_ms = _timed(lambda: verify_greedy_batched(*args, backend="triton", check=False), iters, cuda)
                        figs.update(ref_ms=r_ms, kernel_ms=k_ms, speedup=r_ms / k_ms)
                    table.add("greedy", case, "MISMATCH" if bad else "ok", **figs)
                    for T in ((1.0,) if smoke or dtype != torch.float32 else (1.0, 0.6)):
                        u = torch.rand(B, n + 1, dtype=torch.float64, device=device,
                                       generator=torch.Generator(device=device).manual_seed(seed))
                        ref = verify_tree_sampling_reference(*args, T, u)
                        ker = verify_tree_sampling_batched(*args, T, u, backend="triton")
                        bad = _rows_differ(ref, ker)
                        figs = {"trees_differ": bad, "mean_accept": float(ref[0].double().mean())}
                        if time.perf_counter() < deadline:
                            r_ms = _timed(lambda: verify_tree_sampling_reference(*args, T, u), max(1, iters // 2), cuda)
                            k_ms = _timed(lambda: verify_tree_sampling_batched(*args, T, u, backend="triton",
                                                                               check=False), iters, cuda)
                            figs.update(ref_ms=r_ms, kernel_ms=k_ms, speedup=r_ms / k_ms)
                        table.add(f"sampling T={T}", case, "MISMATCH" if bad else "ok", **figs)
                    del logits, args, ref, ker
                    if cuda:
                        torch.cuda.empty_cache()
                except Exception as e:  # noqa: BLE001 - one shape's crash is reported, the rest still run
                    traceback.print_exc()
                    table.add("kernels", case, "ERROR", error=f"{type(e).__name__}: {e}"[:200])


# ------------------------------------------------------------------ 4. end to end


def tiny_target(vocab: int, device: str, seed: int = 0):
    """A float32 tiny Llama whose next-token distributions are peaky (no near-ties to flip greedy)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specheads.targets import Target

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.mul_(8.0)
    return Target(model.to(device), tokenizer=None, name=f"tiny-peaky-llama-v{vocab}")


def noisy_copy(model, scale: float, seed: int = 1):
    """The target with noise on its LM head: a draft model that is right often, not always."""
    import copy

    import torch

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(scale * w.std() * torch.randn(w.shape, generator=g).to(w))
    return draft


def synthetic_prompts(n: int, vocab: int, seed: int = 0):
    """Token-id prompts with repeats (so the n-gram baseline finds matches); no tokenizer needed."""
    from specheads.data.benchmarks import EvalPrompt

    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))] + motif * rng.randint(2, 4)
        out.append(EvalPrompt(f"p{i}", ("code", "chat", "math")[i % 3], input_ids=ids))
    return out


def check_end_to_end(table: Table, smoke: bool, cuda: bool, workdir: Path) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        table.add("end-to-end", "evaluate kernels on vs off", "skipped", reason="transformers not installed")
        return
    import dataclasses

    import torch

    import specheads.evaluation.suite as suite
    import specheads.kernels as kernels
    import specheads.kernels.verify_greedy as vg
    from specheads.decoding import batched_verify
    from specheads.decoding.drafters import ModelDrafter, TreeShape
    from specheads.methods.medusa import write_medusa_tree
    from specheads.models.medusa import medusa_for_target

    device = "cuda" if cuda else "cpu"
    vocab = 128 if smoke else 512
    target = tiny_target(vocab, device)
    noisy = noisy_copy(target.model, 0.8).to(device)
    head_dir = workdir / "medusa_head"
    heads = medusa_for_target(target, num_heads=3)
    with torch.no_grad():  # a head that is not simply the target: some drafts right, some wrong
        g = torch.Generator().manual_seed(2)
        for p in heads.blocks.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p))
    heads.save_pretrained(head_dir)
    write_medusa_tree(head_dir, [[0.6, 0.2, 0.1, 0.05], [0.4, 0.1, 0.05, 0.02], [0.3, 0.05, 0.02, 0.01]],
                      calibrated_on="gpu_check (fixed)")
    n_prompts, max_new = (3, 8) if smoke else (12, 40)
    prompts = synthetic_prompts(n_prompts, vocab)
    chain, tree = TreeShape("chain", k=4), TreeShape("dynamic", depth=4, topk=2, total_tokens=10)
    methods = [suite.MethodSpec("noisy-chain4", "two_model", chain, draft_model="(in memory)"),
               suite.MethodSpec("noisy-tree", "two_model", tree, draft_model="(in memory)"),
               suite.MethodSpec("medusa-tree", "medusa", TreeShape("static"), head_dir=str(head_dir),
                                medusa_tree_nodes=12),
               suite.MethodSpec("ngram-chain4", "ngram", chain)]
    fields = {f.name for f in dataclasses.fields(suite.EvalConfig)}
    extra = {"repeats": 1} if "repeats" in fields else {}
    bs = (1, 3) if smoke else (1, 4, 12)
    cfg = suite.EvalConfig(methods, max_new_tokens=max_new, temperatures=(0.0,) if smoke else (0.0, 1.0),
                           batch_sizes=bs, batch_prompts=n_prompts, **extra)

    real_build, real_generate, real_load = suite.build_drafter, suite.speculative_generate, suite.load_benchmarks
    real_avail, real_pick, real_kernel = kernels.triton_available, batched_verify.pick_backend, vg.verify_greedy_triton
    calls: list = []
    kernel_calls = [0]

    def build(spec, *a, **k):
        if spec.draft_model == "(in memory)":
            return ModelDrafter(noisy, spec.shape, name=spec.name)
        return real_build(spec, *a, **k)

    def generate(runner, drafter, ps, *a, **k):
        res = real_generate(runner, drafter, ps, *a, **k)
        calls.append((getattr(drafter, "name", "plain"), len(ps), res.tokens,
                      [(list(s.tested), list(s.accepted)) for s in res.stats]))
        return res

    def counting_kernel(*a, **k):
        kernel_calls[0] += 1
        return real_kernel(*a, **k)

    def run(kernels_on: bool):
        calls.clear()
        kernel_calls[0] = 0
        suite.load_benchmarks = lambda spec: prompts
        suite.build_drafter, suite.speculative_generate = build, generate
        vg.verify_greedy_triton = counting_kernel
        if kernels_on and not cuda:  # the interpreter: 'auto' would pick torch for CPU tensors
            batched_verify.pick_backend = lambda backend, logits: "triton" if backend == "auto" else real_pick(backend, logits)
        if not kernels_on:
            kernels.triton_available = lambda: False
        for m in methods:  # build_drafter fills in the static tree; start each run from the same spec
            if m.drafter == "medusa":
                m.shape, m.tree_source = TreeShape("static"), None
        try:
            t0 = time.perf_counter()
            report = suite.evaluate(target, cfg)
            return report, list(calls), kernel_calls[0], time.perf_counter() - t0
        finally:
            suite.build_drafter, suite.speculative_generate, suite.load_benchmarks = real_build, real_generate, real_load
            kernels.triton_available, batched_verify.pick_backend = real_avail, real_pick
            vg.verify_greedy_triton = real_kernel

    on, calls_on, k_on, s_on = run(True)
    off, calls_off, k_off, s_off = run(False)
    same_calls = calls_on == calls_off
    table.add("end-to-end", "evaluate: every decode call, kernels on vs off",
              "ok" if same_calls and len(calls_on) else "MISMATCH", decode_calls=len(calls_on),
              differing_calls=sum(a != b for a, b in zip(calls_on, calls_off)) + abs(len(calls_on) - len(calls_off)),
              kernel_calls_on=k_on, kernel_calls_off=k_off, seconds_on=s_on, seconds_off=s_off)
    if k_on == 0 or k_off != 0:
        table.add("end-to-end", "kernels ran only when on", "MISMATCH", kernel_calls_on=k_on, kernel_calls_off=k_off)
    for m_on, m_off in zip(on["methods"], off["methods"]):
        for T, doms in m_on["by_temperature"].items():
            a_on, a_off = doms["all"], m_off["by_temperature"][T]["all"]
            same = (a_on.get("alpha"), a_on.get("tau")) == (a_off.get("alpha"), a_off.get("tau"))
            table.add("end-to-end", f"{m_on['name']} T={T} α/τ on vs off", "ok" if same else "MISMATCH",
                      alpha=a_on.get("alpha"), tau=a_on.get("tau"), alpha_off=a_off.get("alpha"),
                      tau_off=a_off.get("tau"))
        lossless = m_on["lossless"]["exact"] and m_off["lossless"]["exact"]
        batch_ok = all(r["matches_batch1_plain"] for r in list(m_on["batch"].values()) + list(m_off["batch"].values()))
        figs = {f"spec_tok_s_b{b}_on": r["spec_tokens_per_s"] for b, r in m_on["batch"].items()}
        figs.update({f"spec_tok_s_b{b}_off": r["spec_tokens_per_s"] for b, r in m_off["batch"].items()})
        table.add("end-to-end", f"{m_on['name']} lossless + batches = batch-1 plain",
                  "ok" if lossless and batch_ok else "MISMATCH", shape=m_on["shape"],
                  tree_source=m_on.get("tree_source", "-"), **figs)
    check_engine_batch(table, target, noisy, smoke, cuda)


def check_engine_batch(table: Table, target, noisy, smoke: bool, cuda: bool) -> None:
    """One large batch through the engine: verify_backend triton / torch / None give the same run."""
    from specheads.decoding.drafters import ModelDrafter, TreeShape
    from specheads.decoding.generate import speculative_generate
    from specheads.decoding.runner import TargetRunner
    from specheads.targets import eos_token_ids

    B, max_new = (3, 6) if smoke else (64, 32)
    vocab = target.model.config.vocab_size
    prompts = [p.input_ids for p in synthetic_prompts(B, vocab, seed=7)]
    eos = eos_token_ids(target)
    out = {}
    for backend in ("triton", "torch", None):
        runner = TargetRunner(target.model)
        drafter = ModelDrafter(noisy, TreeShape("dynamic", depth=4, topk=2, total_tokens=10), name="noisy")
        t0 = time.perf_counter()
        res = speculative_generate(runner, drafter, prompts, max_new, 0.0, "greedy", eos, verify_backend=backend)
        out[backend] = (res.tokens, [(list(s.tested), list(s.accepted)) for s in res.stats],
                        time.perf_counter() - t0, sum(map(len, res.tokens)))
    same = out["triton"][:2] == out["torch"][:2] == out[None][:2]
    table.add("end-to-end", f"engine B={B} tree, verify_backend triton/torch/row-by-row", "ok" if same else "MISMATCH",
              tokens=out["triton"][3], tok_s_triton=out["triton"][3] / out["triton"][2],
              tok_s_torch=out["torch"][3] / out["torch"][2], tok_s_rowwise=out[None][3] / out[None][2])


# ------------------------------------------------------------------ main


def check_released_layers(table: Table, cuda: bool) -> None:
    """Training from a feature store frees the target's decoder layers (``Target.release_layers``): on the
    GPU the allocator must get their bytes back, and ``layers_loaded`` must give the same logits again."""
    import torch

    device = "cuda" if cuda else "cpu"
    target = tiny_target(512, device)
    ids = torch.randint(0, 512, (2, 16), device=device)
    with torch.no_grad():
        want = target.model(ids).logits
    layer_bytes = sum(p.numel() * p.element_size() for p in target.layers.parameters())
    before = torch.cuda.memory_allocated() if cuda else 0
    target.release_layers(lambda: tiny_target(512, device))
    freed = before - torch.cuda.memory_allocated() if cuda else None
    with target.layers_loaded(), torch.no_grad():
        got = target.model(ids).logits
    same = bool(torch.equal(got, want))
    ok = same and target.layers_released and (freed is None or freed >= layer_bytes)
    table.add("memory", "release_layers frees the decoder layers; layers_loaded gives the same logits",
              "ok" if ok else "MISMATCH", layer_bytes=layer_bytes,
              freed_bytes="n/a (cpu)" if freed is None else freed, same_logits=same)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny shapes, kernels in the Triton interpreter")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="write gpu_check.json and gpu_check.md here")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="the run's time budget: kernel timings stop at 60%% of it (the checks go on)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["imports", "kernels", "e2e", "memory"])
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported: set before any import of it
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    table = Table()
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu (Triton interpreter)",
            "kernels_from": KERNELS_FROM}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    print("gpu_check:", json.dumps(info), flush=True)
    if not cuda and not args.cpu_smoke:
        print("gpu_check: no CUDA device; run with --cpu-smoke for the CPU-side logic", file=sys.stderr)
        return 3
    workdir = Path(args.out or tempfile.mkdtemp(prefix="gpu_check_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    sections = [("imports", lambda: check_imports(table, args.cpu_smoke))]
    if info["triton"] is None:
        table.add("kernels", "triton import", "skipped", reason="triton not installed")
    else:
        sections.append(("kernels", lambda: check_kernels(table, args.cpu_smoke, cuda, t_start + args.budget_s * 0.6)))
    sections.append(("e2e", lambda: check_end_to_end(table, args.cpu_smoke, cuda,
                                                     Path(tempfile.mkdtemp(prefix="gpu_check_head_")))))
    sections.append(("memory", lambda: check_released_layers(table, cuda)))
    for name, fn in sections:
        if name in args.skip:
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a crashed section is a failed check, reported in the table
            traceback.print_exc()
            table.add(name, "section crashed", "ERROR", error=f"{type(e).__name__}: {e}"[:300])
    elapsed = time.perf_counter() - t_start
    status = 1 if table.failed() else 3 if table.incomplete() else 0
    md = table.markdown()
    print("\n## gpu_check figures\n\n" + md)
    print(f"\ngpu_check: {'MISMATCH' if status == 1 else 'INCOMPLETE' if status == 3 else 'all checks match'} "
          f"({len(table.rows)} rows, {elapsed:.0f} s)")
    (workdir / "gpu_check.json").write_text(json.dumps({"info": info, "seconds": elapsed, "status": status,
                                                        "rows": table.rows}, indent=1, default=str))
    (workdir / "gpu_check.md").write_text(f"# gpu_check\n\n{json.dumps(info)}\n\n{md}\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
