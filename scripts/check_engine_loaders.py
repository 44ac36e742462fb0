"""Run the engines' own pure-Python loader pieces, read from their release wheels, on our exported folders (CPU).

A benchmark-style check, not CI: it needs the wheels (``pip download --no-deps vllm==0.33.0 vllm==0.32.0
-d WHEELS``) and, for the speculators check, speculators 0.9.0 importable (``--speculators-path`` = a
``pip install --no-deps --target`` folder with speculators, hs-connectors, loguru, pydantic-settings,
openai, distro, jiter). Nothing of the engines is copied into the project: the functions are compiled
from the wheel's source at run time (imports of the engine's heavy modules replaced by small stand-ins
for the layers they build, e.g. ``ParallelLMHead`` -> a plain weight of the same shape).

    .venv/bin/python scripts/check_engine_loaders.py --wheels /tmp/wheels [--speculators-path DIR]

Checks, on tiny random heads exported by specheads (EAGLE-3 on aux layers (3, 0, 2) of a 4-layer target,
whose default would be (2, 2, 1); Medusa with 3 heads x 2 blocks):

* vLLM 0.32.0 and 0.33.0, EAGLE-3 ``vllm/`` and ``speculators/`` folders: the V1 runner's
  ``GPUModelRunner._get_eagle3_aux_layers_from_config`` and the V2 runner's
  ``get_eagle3_aux_layers_from_config`` give the trained layers (speculators folders first converted by
  vLLM's own ``SpeculatorsConfig.extract_transformers_pre_trained_config`` and validated by
  ``validate_speculators_config``);
* vLLM 0.32.0, Medusa ``vllm/`` and ``medusa/`` folders: ``MedusaConfig.from_pretrained`` then the
  ``Medusa`` module's own ``load_weights``; every parameter must be in the returned loaded set (what
  vLLM's default loader enforces) and equal to the head's tensor;
* speculators 0.9.0: ``SpeculatorModel.from_pretrained`` on the ``speculators/`` folder and one forward
  whose draft logits equal ours.
* DFlash (a ``build_method("dflash", block_size=4)`` head on aux layers (3, 1, 2), 2 draft layers), with the
  vLLM 0.34.0 wheel in ``--wheels`` and the SGLang 0.5.23 wheel in ``--sglang-wheel``: vLLM's
  ``get_eagle3_aux_layers_from_config``, ``_get_dflash_fc_input_size`` and ``_dflash_layer_causal`` on the
  ``vllm/`` folder and on the ``speculators/`` folder after vLLM's own ``SpeculatorsConfig`` conversion
  (``update_dflash``); SGLang's ``parse_dflash_draft_config`` + ``resolve_target_layer_ids``,
  ``LlamaForCausalLM.set_dflash_layers_to_capture`` (the captured layers), ``_get_dflash_layer_attention_params``
  (bidirectional layers) and ``DFlashDraftModel.load_weights`` itself on the ``sglang/`` folder (into a module of
  the engine's parameter names and shapes: every parameter loaded, values equal to the head's).

Prints one line per check and the versions checked; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
import textwrap
import types
import zipfile
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

AUX, V, H, LAYERS = (3, 0, 2), 256, 64, 4
DFLASH_AUX = (3, 1, 2)


# --------------------------------------------------------------------------- reading code from a wheel


def wheel_source(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(member).decode()


def _strip_engine_imports(tree: ast.Module, package: str) -> ast.Module:
    """Drop ``from <package>...`` and relative imports (their names come from the stand-ins)."""
    keep = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(package)):
            continue
        if isinstance(node, ast.Import) and any(a.name.startswith(package) for a in node.names):
            continue
        keep.append(node)
    tree.body = keep
    return tree


def compile_module(source: str, package: str, namespace: dict) -> dict:
    """Execute a module's source with its engine imports removed and annotations left unevaluated."""
    tree = _strip_engine_imports(ast.parse(source), package)
    module = types.ModuleType(f"engine_piece_{len(sys.modules)}")  # dataclasses look their module up
    sys.modules[module.__name__] = module
    ns = module.__dict__
    ns.update(namespace)
    exec(compile("from __future__ import annotations\n", "<future>", "exec"), ns)
    exec(compile(tree, "<wheel>", "exec", flags=__import__("__future__").annotations.compiler_flag,
                 dont_inherit=True), ns)
    return ns


def compile_function(source: str, name: str, cls: str | None = None, namespace: dict | None = None):
    """One function (or method of ``cls``) from a module's source."""
    tree = ast.parse(source)
    nodes = tree.body
    if cls is not None:
        nodes = next(n for n in nodes if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in nodes if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    src = textwrap.dedent(ast.get_source_segment(source, fn) or ast.unparse(fn))
    ns = dict(namespace or {})
    exec(compile("from __future__ import annotations\n" + src, f"<{name}>", "exec"), ns)
    return ns[name]


# --------------------------------------------------------------------------- the exported folders


def make_exports(root: Path) -> dict:
    from specheads.export import export_head
    from tests.conftest import make_tiny_target
    from tests.export.test_export import make_head, save_head

    target = make_tiny_target("llama", vocab=V, hidden=H, layers=LAYERS)
    target.model.save_pretrained(root / "target")
    heads = {}
    for method in ("eagle3", "medusa"):
        head = make_head(method, target)
        folder = save_head(head, root / method)
        heads[method] = (head, export_head(folder, root / f"out-{method}", "all", str(root / "target")))
    from tests.export.test_dflash_export import make_dflash

    head, folder = make_dflash(target, root / "dflash", aux=DFLASH_AUX, num_layers=2)
    heads["dflash"] = (head, export_head(folder, root / "out-dflash", "all", str(root / "target")))
    return {"target": target, "heads": heads}


# --------------------------------------------------------------------------- the checks


def hf_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def spec_config_for(hf) -> types.SimpleNamespace:
    return types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=hf), method="eagle3")


def vllm_speculators_draft_config(wheel: Path, folder: Path):
    """vLLM's own conversion of a speculators config.json into the drafter's config."""
    from transformers import PretrainedConfig

    algos = compile_module(wheel_source(wheel, "vllm/transformers_utils/configs/speculators/algos.py"), "vllm", {})
    base_src = wheel_source(wheel, "vllm/transformers_utils/configs/speculators/base.py")
    base = compile_module(base_src, "vllm", {"SUPPORTED_SPECULATORS_TYPES": algos["SUPPORTED_SPECULATORS_TYPES"],
                                             "without_trust_remote_code": lambda kw: kw})
    config_dict = json.loads((folder / "config.json").read_text())
    base["SpeculatorsConfig"].validate_speculators_config(config_dict)
    speculative = base["SpeculatorsConfig"].build_vllm_speculative_config(config_dict)
    pre = base["SpeculatorsConfig"].extract_transformers_pre_trained_config(json.loads(json.dumps(config_dict)))
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**pre) if "model_type" in pre else PretrainedConfig(**pre)
    return hf, speculative


def check_vllm_eagle3(wheel: Path, version: str, exports: dict, results: list) -> None:
    _, out = exports["heads"]["eagle3"]
    try:  # vLLM 0.34 ships only the V2 runner
        v1 = compile_function(wheel_source(wheel, "vllm/v1/worker/gpu_model_runner.py"),
                              "_get_eagle3_aux_layers_from_config", cls="GPUModelRunner")
    except KeyError:
        v1 = None
    v2 = compile_function(wheel_source(wheel, "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"),
                          "get_eagle3_aux_layers_from_config")
    for layout in ("vllm", "speculators"):
        if layout == "vllm":
            hf = hf_config(out / "vllm")
            extra = ""
        else:
            hf, speculative = vllm_speculators_draft_config(wheel, out / "speculators")
            extra = f"{speculative}, norm_before_residual={hf.norm_before_residual}"
            ok = speculative["method"] == "eagle3" and hf.norm_before_residual is False
            results.append((f"vllm {version}", "EAGLE-3", "speculators/", "SpeculatorsConfig conversion", ok, extra))
        spec = spec_config_for(hf)
        runs = [("V2 runner", v2(spec))]
        if v1 is not None:
            runs.insert(0, ("V1 runner", v1(types.SimpleNamespace(speculative_config=spec))))
        for runner, ids in runs:
            ok = ids is not None and sorted(set(ids)) == sorted(AUX)
            results.append((f"vllm {version}", "EAGLE-3", f"{layout}/", f"{runner} aux ids", ok,
                            f"captures {ids} (trained {sorted(AUX)})"))


class _ParallelLMHead(nn.Module):
    """Stand-in for vLLM's ParallelLMHead: a (vocab, hidden) weight, no parallelism."""

    def __init__(self, num_embeddings, embedding_dim, *args, **kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))


def check_vllm_medusa(wheel: Path, version: str, exports: dict, results: list) -> None:
    head, out = exports["heads"]["medusa"]
    try:
        cfg_src = wheel_source(wheel, "vllm/transformers_utils/configs/medusa.py")
        model_src = wheel_source(wheel, "vllm/model_executor/models/medusa.py")
    except KeyError:
        results.append((f"vllm {version}", "Medusa", "vllm/, medusa/", "no Medusa in this release", True,
                        "models/medusa.py absent: not served"))
        return
    config_ns = compile_module(cfg_src, "vllm", {"without_trust_remote_code": lambda kw: kw})
    model_ns = compile_module(model_src, "vllm", {
        "VllmConfig": object, "ParallelLMHead": _ParallelLMHead, "maybe_prefix": lambda p, n: f"{p}.{n}" if p else n,
        "LogitsProcessor": lambda *a, **k: None,
        "default_weight_loader": lambda param, w: param.data.copy_(w)})
    from safetensors.torch import load_file

    for layout in ("vllm", "medusa"):
        folder = out / layout
        cfg = config_ns["MedusaConfig"].from_pretrained(str(folder))
        vllm_config = types.SimpleNamespace(speculative_config=spec_config_for(cfg))
        module = model_ns["Medusa"](vllm_config=vllm_config)
        weights_file = json.loads((folder / "specheads_export.json").read_text())["weights"]
        loaded = module.load_weights(load_file(str(folder / weights_file)).items())
        params = dict(module.named_parameters())
        missing = sorted(set(params) - set(loaded))
        ours = head.state_dict()
        equal = all(torch.equal(p, ours[name]) for name, p in params.items())
        ok = not missing and equal
        results.append((f"vllm {version}", "Medusa", f"{layout}/", "MedusaConfig + Medusa.load_weights", ok,
                        f"{len(loaded)}/{len(params)} parameters loaded, values equal: {equal}"
                        + (f", missing {missing}" if missing else "")))


def _dflash_wheel_has(wheel: Path) -> bool:
    with zipfile.ZipFile(wheel) as z:
        return "vllm/model_executor/models/qwen3_dflash.py" in z.namelist()


def check_vllm_dflash(wheel: Path, version: str, exports: dict, results: list) -> None:
    if not _dflash_wheel_has(wheel):
        results.append((f"vllm {version}", "DFlash", "vllm/", "no qwen3_dflash in this release", None, "not checked"))
        return
    head, out = exports["heads"]["dflash"]
    aux_fn = compile_function(wheel_source(wheel, "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"),
                              "get_eagle3_aux_layers_from_config")
    src = wheel_source(wheel, "vllm/model_executor/models/qwen3_dflash.py")
    causal_fn = compile_function(src, "_dflash_layer_causal", namespace={"_SLIDING_ATTENTION": "sliding_attention"})
    fc_fn = compile_function(src, "_get_dflash_fc_input_size",
                             namespace={"get_eagle3_aux_layers_from_config": aux_fn})
    fc_cols = head.fc.weight.shape[1]
    for layout in ("vllm", "speculators"):
        if layout == "vllm":
            hf = hf_config(out / "vllm")
        else:
            hf, speculative = vllm_speculators_draft_config(wheel, out / "speculators")
            ok = speculative == {"method": "dflash", "num_speculative_tokens": head.config.block_size - 1}
            results.append((f"vllm {version}", "DFlash", "speculators/", "SpeculatorsConfig conversion", ok,
                            f"{speculative}, dflash_config={hf.dflash_config}"))
        spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=hf), method="dflash")
        ids = aux_fn(spec)
        results.append((f"vllm {version}", "DFlash", f"{layout}/", "V2 runner aux ids",
                        ids is not None and sorted(set(ids)) == sorted(DFLASH_AUX),
                        f"captures {ids} (trained {sorted(DFLASH_AUX)})"))
        fc_in = fc_fn(types.SimpleNamespace(speculative_config=spec))
        results.append((f"vllm {version}", "DFlash", f"{layout}/", "_get_dflash_fc_input_size", fc_in == fc_cols,
                        f"fc input {fc_in} (head {fc_cols})"))
        causal = [causal_fn(hf, i) for i in range(hf.num_hidden_layers)]
        results.append((f"vllm {version}", "DFlash", f"{layout}/", "_dflash_layer_causal", not any(causal),
                        f"causal per layer {causal} (trained bidirectional)"))


class _Param(nn.Parameter):
    pass


def _stacked_loader(offsets: dict):
    def load(param, weight, shard=None):
        if shard is None:
            param.data.copy_(weight)
            return
        start = offsets[shard]
        param.data[start:start + weight.shape[0]].copy_(weight)
    return load


def check_sglang_dflash(wheel: Path | None, exports: dict, results: list) -> None:
    if wheel is None:
        results.append(("sglang", "DFlash", "sglang/", "loader pieces", None, "no --sglang-wheel given"))
        return
    version = wheel.name.split("-")[1]
    head, out = exports["heads"]["dflash"]
    folder = out / "sglang"
    hf = hf_config(folder)
    utils = compile_module(wheel_source(wheel, "sglang/srt/speculative/dflash_utils.py"), "sglang",
                           {"tree_speculative_sampling_target_only": None, "is_npu": lambda: False})
    draft = utils["parse_dflash_draft_config"](draft_hf_config=hf)
    ids = draft.resolve_target_layer_ids(target_num_layers=LAYERS, draft_num_layers=hf.num_hidden_layers)
    capture = compile_function(wheel_source(wheel, "sglang/srt/models/llama.py"), "set_dflash_layers_to_capture",
                               cls="LlamaForCausalLM")
    runner = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace())
    capture(runner, ids)
    # llama.py LlamaModel.forward hands over the input of layer i for i in layers_to_capture: our layer i.
    captured = sorted(runner.model.layers_to_capture)
    results.append((f"sglang {version}", "DFlash", "sglang/", "parse_dflash_draft_config + set_dflash_layers_to_capture",
                    captured == sorted(DFLASH_AUX) and draft.block_size == head.config.block_size
                    and draft.mask_token_id == head.config.mask_token_id,
                    f"target_layer_ids {ids} -> captures the inputs of layers {captured} (trained "
                    f"{sorted(DFLASH_AUX)}); block_size {draft.block_size}, mask_token_id {draft.mask_token_id}"))
    model_src = wheel_source(wheel, "sglang/srt/models/dflash.py")
    attn_type = types.SimpleNamespace(DECODER="DECODER", ENCODER_ONLY="ENCODER_ONLY")
    ns = {"AttentionType": attn_type, "get_dflash_layer_types": utils["get_dflash_layer_types"],
          "get_dflash_attention_sliding_window_size": utils["get_dflash_attention_sliding_window_size"]}
    ns["_get_dflash_attention_type"] = compile_function(model_src, "_get_dflash_attention_type", namespace=ns)
    params_fn = compile_function(model_src, "_get_dflash_layer_attention_params", namespace=ns)
    kinds = [params_fn(hf, i)[1] for i in range(hf.num_hidden_layers)]
    results.append((f"sglang {version}", "DFlash", "sglang/", "_get_dflash_layer_attention_params",
                    all(k == "ENCODER_ONLY" for k in kinds), f"attention per layer {kinds} (trained bidirectional)"))
    # DFlashDraftModel.load_weights on a module with the engine's parameter names and shapes.
    c, Hh = hf, hf.hidden_size
    hd, nh, nkv, inter = c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    module = nn.Module()
    shapes = {"fc.weight": (Hh, len(ids) * Hh), "hidden_norm.weight": (Hh,), "norm.weight": (Hh,)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, Hh),
                       p + "self_attn.o_proj.weight": (Hh, nh * hd), p + "self_attn.q_norm.weight": (hd,),
                       p + "self_attn.k_norm.weight": (hd,), p + "mlp.gate_up_proj.weight": (2 * inter, Hh),
                       p + "mlp.down_proj.weight": (Hh, inter), p + "input_layernorm.weight": (Hh,),
                       p + "post_attention_layernorm.weight": (Hh,)})
    params = {}
    for name, shape in shapes.items():
        t = nn.Parameter(torch.full(shape, float("nan")), requires_grad=False)
        if "qkv_proj" in name:
            t.weight_loader = _stacked_loader({"q": 0, "k": nh * hd, "v": (nh + nkv) * hd})
        elif "gate_up_proj" in name:
            t.weight_loader = _stacked_loader({0: 0, 1: inter})
        params[name] = t
    stand_in = types.SimpleNamespace(named_parameters=lambda: list(params.items()), projector_type=None,
                                     is_nemotron_35_draft=False, num_context_features=len(ids), config=c)
    load = compile_function(model_src, "load_weights", cls="DFlashDraftModel",
                            namespace={"default_weight_loader": lambda p, w: p.data.copy_(w), "torch": torch,
                                       "_logical_linear_weight_shape": None})
    from safetensors.torch import load_file

    load(stand_in, load_file(str(folder / "model.safetensors")).items())
    ours = head.state_dict()
    expect = {}
    for name in shapes:
        if "qkv_proj" in name:
            b = name.replace("qkv_proj", "{}")
            expect[name] = torch.cat([ours[b.format(x)] for x in ("q_proj", "k_proj", "v_proj")])
        elif "gate_up_proj" in name:
            b = name.replace("gate_up_proj", "{}")
            expect[name] = torch.cat([ours[b.format(x)] for x in ("gate_proj", "up_proj")])
        elif name == "fc.weight":  # the engine concatenates the captured states in ascending layer order
            chunks = ours[name].chunk(len(DFLASH_AUX), dim=1)
            expect[name] = torch.cat([chunks[j] for j in sorted(range(len(DFLASH_AUX)), key=lambda j: DFLASH_AUX[j])], 1)
        else:
            expect[name] = ours[name]
    unloaded = sorted(n for n, p in params.items() if p.isnan().any())
    equal = all(torch.equal(params[n].data, expect[n]) for n in shapes if n not in unloaded)
    results.append((f"sglang {version}", "DFlash", "sglang/", "DFlashDraftModel.load_weights", not unloaded and equal,
                    f"{len(shapes) - len(unloaded)}/{len(shapes)} parameters loaded, values equal: {equal}"
                    + (f", never loaded {unloaded}" if unloaded else "")))


def check_speculators(path: str | None, exports: dict, results: list) -> None:
    if path:
        sys.path.insert(0, path)
    try:
        from speculators import SpeculatorModel
        from speculators.models.eagle3 import Eagle3SpeculatorConfig
    except ImportError as e:
        results.append(("speculators", "EAGLE-3", "speculators/", "from_pretrained", None, f"not importable: {e}"))
        return
    head, out = exports["heads"]["eagle3"]
    folder = out / "speculators"
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(folder))
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(str(folder), config=cfg).eval()
    g = torch.Generator().manual_seed(0)
    T = 7
    feats = {layer: torch.randn(1, T, H, generator=g) for layer in AUX}
    ids = torch.randint(0, V, (1, T), generator=g)
    pos = torch.arange(T)[None]
    got = {}
    model.lm_head.register_forward_hook(lambda m, i, o: got.__setitem__("logits", o))
    with torch.no_grad():
        model(hidden_states=torch.cat([feats[i] for i in sorted(AUX)], -1), input_ids=ids,
              document_ids=torch.zeros(1, T, dtype=torch.long), position_ids=pos, ttt_steps=1)
        head.attach(exports["target"])
        _, ours = head.step(head.fuse(torch.cat([feats[i] for i in AUX], -1)), ids, pos)
    diff = (got["logits"] - ours).abs().max().item()
    agree = int((got["logits"].argmax(-1) == ours.argmax(-1)).sum())
    ok = diff < 1e-4 and not model.embed_tokens.weight.isnan().any()
    from importlib.metadata import version

    results.append((f"speculators {version('speculators')}", "EAGLE-3", "speculators/",
                    "SpeculatorModel.from_pretrained + forward", ok,
                    f"max logit difference {diff:.2e}, argmax agree {agree}/{T}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", required=True, type=Path, help="folder with vllm-0.32.0 / vllm-0.33.0 wheels")
    ap.add_argument("--speculators-path", default=None, help="a folder to import speculators 0.9.0 from")
    ap.add_argument("--sglang-wheel", default=None, type=Path, help="the sglang 0.5.23 wheel (DFlash checks)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results: list = []
    with tempfile.TemporaryDirectory() as tmp:
        exports = make_exports(Path(tmp))
        for wheel in sorted(args.wheels.glob("vllm-*.whl")):
            version = wheel.name.split("-")[1]
            check_vllm_eagle3(wheel, version, exports, results)
            check_vllm_medusa(wheel, version, exports, results)
            check_vllm_dflash(wheel, version, exports, results)
        check_sglang_dflash(args.sglang_wheel, exports, results)
        check_speculators(args.speculators_path, exports, results)
    failed = 0
    for engine, head, layout, check, ok, detail in results:
        mark = "skip" if ok is None else "ok" if ok else "FAIL"
        failed += ok is False
        print(f"{mark:4}  {engine:18} {head:8} {layout:14} {check}: {detail}")
    print(f"{len(results) - failed} ok/skipped, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
