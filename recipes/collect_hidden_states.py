"""Recipe: frozen target + prepared data -> feature store for offline training.

    python recipes/collect_hidden_states.py [method=eagle3] [collect.dtype=fp8_e4m3] [output_dir=...]
    torchrun --nproc_per_node 2 recipes/collect_hidden_states.py ...   (or accelerate launch; each
    process takes a disjoint share of the shards, the last one to finish writes the manifest)
    torchrun --nproc_per_node 8 recipes/collect_hidden_states.py target.parallel=tp ...   (the target split
    over a node's processes, which read the same samples: one share of the shards per node, written by its rank 0)
    specheads collect ...            (same overrides)
"""

import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from specheads.data.features import CollectOptions, check_collect_options, collect_hidden_states
from specheads.data.prepare import check_prepared_matches, load_prepared
from specheads.errors import ConfigError, check_output_folder, renamed_setting, user_errors
from specheads.ranges import check_number, check_numbers
from specheads.overrides import check_command_line
from specheads.hardware import machine_description, resolve_device
from specheads.serving.engine import EngineRefusedError
from specheads.targets import end_process_group, load_target
from specheads.targets.chat_templates import resolve as resolve_chat_template
from specheads.targets.loading import check_parallel
from specheads.targets.parallel import leave_unless_first_rank
from specheads.methods import build_method
from specheads.methods.base import FusedLayers
from specheads.data.store import FeatureSpec
try:  # the method/ group's schemas (conf/method/medusa*.yaml extend them)
    from specheads.recipes.train import register_configs
except ModuleNotFoundError as e:  # an install older than the packaged recipes: recipes/ is sys.path[0]
    if e.name not in ("specheads.recipes", "specheads.recipes.train"):
        raise
    from train import register_configs

register_configs()

log = logging.getLogger("specheads.collect")


def process_device(device: str, rank: int) -> str:
    """One GPU per process under a launcher (LOCAL_RANK); CPU stays CPU; ``auto``: a GPU when present."""
    device = resolve_device(device)
    if str(device).startswith("cuda") and "LOCAL_RANK" in os.environ:
        return f"cuda:{os.environ['LOCAL_RANK']}"
    return str(device)


def feature_spec(method_cfg: DictConfig, target) -> FeatureSpec:
    """The features the trainer's Method will ask for (the same registry the train recipe uses)."""
    kwargs = OmegaConf.to_container(method_cfg, resolve=True)
    method = build_method(kwargs.pop("name"), **kwargs)
    if hasattr(method, "bind"):  # methods whose layers default from the target's depth
        method.bind(target)
    return method.feature_spec


@hydra.main(config_path="../conf", config_name="collect_hidden_states", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors("collect"):
        collect(cfg)
    end_process_group()
    leave_unless_first_rank()  # after every rank wrote its shards: see specheads.targets.parallel


ENGINES = ("hf", "vllm", "auto")


def check_config(cfg: DictConfig) -> None:
    """Every setting's range, with no file read and nothing loaded (``specheads run`` calls it before its first
    stage; the folders, the target's layers and a store already in output_dir are checked when the stage starts)."""
    engine = cfg.get("engine", "hf")
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine}: use hf (a transformers forward here), vllm (the engine venv's vLLM) or "
                          "auto (vllm where its venv exists)")
    resolve_device(cfg.target.get("device", "cpu"), "target.device")
    check_parallel(cfg.target.get("parallel", "none"))
    check_number("target.tp_size", cfg.target.get("tp_size"), "?>= 0", integer=True,
                  note="0 = the processes of a node")
    check_collect_options(CollectOptions(**OmegaConf.to_container(cfg.collect, resolve=True)))
    check_number("vllm.max_model_len", cfg.vllm.max_model_len, ">= 1", integer=True,
                 note="at least the longest prepared row")
    check_number("vllm.kv_cache_gib", cfg.vllm.kv_cache_gib, "?> 0")
    check_number("vllm.tensor_parallel_size", cfg.vllm.tensor_parallel_size, ">= 1", integer=True)
    method = OmegaConf.to_container(cfg.method, resolve=True)
    if method.get("aux_layers") is not None:
        check_numbers("method.aux_layers", method["aux_layers"], ">= 0", integer=True, allow_empty=False,
                      note="inputs of decoder layers counted from 0 (null: the method's default for the target)")
    built = build_method(method.pop("name"), **method)  # its constructor checks its own settings
    layers_unknown = isinstance(built, FusedLayers) and built.aux_layers is None  # until the target is read
    if not layers_unknown and built.feature_spec.online_only:
        raise ConfigError(f"method={cfg.method.name} trains the target itself (online only): it has no features to "
                          "collect; train it online (specheads train with prepared_dir and no features_dir; "
                          "specheads run offline=false)")


def collect(cfg: DictConfig) -> None:
    check_config(cfg)  # before any work
    rank = int(os.environ.get("RANK", 0))
    output_dir = renamed_setting("collect", "out_dir", "output_dir", cfg.out_dir) or cfg.output_dir
    check_output_folder(output_dir, "out_dir" if cfg.out_dir else "output_dir")
    if cfg.target.get("chat_template"):  # a missing template file: one line now, not after the target loads
        resolve_chat_template(cfg.target.chat_template)
    engine = cfg.get("engine", "hf")
    auto = engine == "auto"
    if auto:
        engine = auto_engine(cfg)
    dataset, meta = load_prepared(cfg.prepared_dir)
    if "images" in dataset.column_names and engine == "vllm":  # image rows: the transformers forward reads pixels
        if not auto:
            raise ConfigError(f"{cfg.prepared_dir} holds image rows, which engine=vllm does not collect yet: use "
                              "engine=hf (the target's own forward, its vision encoder included)")
        log.info("engine=auto: the prepared rows hold images; the transformers forward runs the forward passes")
        engine = "hf"
    check_before_loading(cfg, dataset, output_dir)
    captured = _captured_target(cfg, meta, output_dir, dataset, engine, rank) if cfg.get("captured", True) else None
    if captured is not None:
        target, spec = captured
    else:
        try:
            target, spec = _forward_target(cfg, meta, output_dir, dataset, engine, rank)
        except EngineRefusedError as e:
            if not auto:
                raise
            log.warning("engine=auto: vLLM refused the target (%s); the transformers forward runs the forward passes",
                        e)
            engine = "hf"
            target, spec = _forward_target(cfg, meta, output_dir, dataset, engine, rank)
    try:
        _collect(cfg, target, spec, dataset, meta, output_dir, engine)
    finally:
        if hasattr(target, "close"):
            target.close()


def described_target(name_or_path: str):
    """The target built on the meta device from its folder's config.json (its layers and width, no weights read),
    or None where that is not cheap and sure: a target that is no local model folder, or a config this
    transformers cannot build (the loaded target's own checks then apply)."""
    from specheads.planning import meta_target
    from specheads.targets import resolve_target_path

    path = Path(resolve_target_path(name_or_path))
    if not (path / "config.json").is_file():
        return None
    try:
        from transformers import AutoConfig

        return meta_target(AutoConfig.from_pretrained(str(path)), str(name_or_path))
    except Exception as e:  # noqa: BLE001 - an early check only: loading the target reports its own failure
        log.debug("no early description of %s: %s", name_or_path, e)
        return None


def check_before_loading(cfg: DictConfig, dataset, output_dir: str) -> None:
    """What can be refused before the target loads: aux layers the target lacks (its depth from config.json) and
    a store in ``output_dir`` begun with another target, layers, dtype or data (its plan.json)."""
    from specheads.data.features import check_store_plan, sample_lengths
    from specheads.data.store import canonical_dtype

    described = described_target(cfg.target.name_or_path)
    spec = feature_spec(cfg.method, described) if described is not None else None
    whole = cfg.collect.get("max_minutes") is None  # a time budget collects a share of the rows
    check_store_plan(output_dir, target=str(cfg.target.name_or_path), dtype=canonical_dtype(cfg.collect.dtype),
                     num_layers=described.num_layers if described is not None else None,
                     hidden_size=described.hidden_size if described is not None else None,
                     aux_layers=list(spec.aux_layers) if spec is not None else None,
                     has_last=spec.need_last if spec is not None else None,
                     num_samples=len(dataset) if whole else None,
                     num_tokens=int(sum(sample_lengths(dataset))) if whole else None)


def auto_engine(cfg: DictConfig) -> str:
    """``engine=auto``: vLLM where the engine venv is found and can take the target (a model folder, no
    ``target.parallel``), else the transformers forward; the choice and its reason are logged."""
    from specheads.serving.engine import EngineNotFoundError, find_engine
    from specheads.targets import resolve_target_path

    if cfg.target.get("parallel", "none") != "none":
        why = f"target.parallel={cfg.target.parallel}"
    elif not Path(resolve_target_path(cfg.target.name_or_path)).is_dir():
        why = "the target is not a model folder vLLM reads"
    else:
        try:
            found = find_engine(cfg.vllm.python)
        except EngineNotFoundError:
            why = "no vLLM engine here (bash scripts/setup_engine.sh makes one)"
        else:
            log.info("engine=auto: vLLM %s (%s) runs the forward passes", found.version, found.python)
            return "vllm"
    log.info("engine=auto: the transformers forward runs the forward passes (%s)", why)
    return "hf"


def _forward_target(cfg: DictConfig, meta: dict, output_dir: str, dataset, engine: str, rank: int):
    """The target that runs collection's forward passes: the engine's, or the Hugging Face model loaded here."""
    if engine == "vllm":
        return _engine_target(cfg, meta, output_dir, dataset)
    log.info("loading the target %s (%s) for %d prepared rows", cfg.target.name_or_path, cfg.target.dtype,
             len(dataset))
    target = load_target(cfg.target.name_or_path, cfg.target.dtype,
                         process_device(cfg.target.get("device", "cpu"), rank),
                         parallel=cfg.target.get("parallel", "none"), tp_size=cfg.target.get("tp_size") or None,
                         max_memory=cfg.target.get("max_memory") or None,
                         chat_template=cfg.target.get("chat_template"))
    check_prepared_matches(meta, target)
    return target, feature_spec(cfg.method, target)


def _captured_target(cfg: DictConfig, meta: dict, output_dir: str, dataset, engine: str, rank: int):
    """States captured while vLLM regenerated the answers (``specheads.data.capture_cache``), when the prepared
    data has them for the method's layers: (a target serving them, spec), a forward set up only for rows they
    lack; else None."""
    from specheads.data.capture_cache import CaptureCache, CapturedTarget, capture_dir
    from specheads.data.engine_features import meta_target

    folder = capture_dir(cfg.prepared_dir)
    if not meta.get("captured") or not (folder / "meta.json").is_file():
        return None
    if cfg.target.get("parallel", "none") != "none":
        log.info("target.parallel=%s: the states captured in %s are not read (collected with a forward)",
                 cfg.target.parallel, folder)
        return None
    cache = CaptureCache(folder)
    described = meta_target(cfg.target.name_or_path, cfg.target.get("chat_template"))
    check_prepared_matches(meta, described)
    spec = feature_spec(cfg.method, described)
    if not cache.covers(spec.aux_layers, spec.need_last):
        log.info("%s holds layers %s; method %s needs %s: collected with a forward instead", folder, cache.layers,
                 cfg.method.name, list(spec.aux_layers))
        return None
    found = cache.count(dataset["input_ids"])
    log.info("%d of %d prepared rows have their states captured while vLLM answered (%s, %s)%s", found, len(dataset),
             folder, cache.meta.get("dtype"), "" if found == len(dataset) else
             f"; the other {len(dataset) - found} are collected with engine={engine}")
    return CapturedTarget(described, cache, lambda: _forward_target(cfg, meta, output_dir, dataset, engine, rank)[0]), spec


def _engine_target(cfg: DictConfig, meta: dict, output_dir: str, dataset):
    """The engine-backed target (``specheads.data.engine_features``), checked against the prepared data and the
    method's layers before the engine starts."""
    from specheads.data.engine_features import engine_target, meta_target

    if cfg.target.get("parallel", "none") != "none":
        raise ConfigError("engine=vllm splits a large target itself: set vllm.tensor_parallel_size, not "
                          f"target.parallel={cfg.target.parallel}")
    described = meta_target(cfg.target.name_or_path, cfg.target.get("chat_template"))
    check_prepared_matches(meta, described)
    spec = feature_spec(cfg.method, described)
    longest = max((len(r) for r in dataset["input_ids"]), default=0)
    if longest > int(cfg.vllm.max_model_len):
        raise ConfigError(f"vllm.max_model_len={cfg.vllm.max_model_len} is shorter than the longest prepared row "
                          f"({longest} tokens): raise it")
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    target = engine_target(described, spec.aux_layers, spec.need_last, str(cfg.target.dtype), cfg.vllm.python,
                           int(cfg.vllm.max_model_len), output_dir, cfg.vllm.kv_cache_gib,
                           int(cfg.vllm.tensor_parallel_size))
    return target, spec


def _collect(cfg: DictConfig, target, spec, dataset, meta: dict, output_dir: str, engine: str) -> None:
    # Shards go to data-parallel ranks: a tensor-parallel group shares one, its first rank writes.
    layout = target.layout
    rank, world = layout.rank, layout.world
    opts = CollectOptions(**OmegaConf.to_object(cfg.collect), rank=layout.dp_rank, world_size=layout.dp_size,
                          write=layout.writes)
    source = {"prepared_dir": str(Path(cfg.prepared_dir).resolve()), "method": cfg.method.name,
              "engine": "captured" if hasattr(target, "cache") else engine,
              **{k: meta.get(k) for k in ("num_samples", "num_tokens", "chat_template_sha", "max_length")},
              "target_dtype": target.dtype_choice.record() if target.dtype_choice else str(target.dtype),
              "machine": machine_description(target.device)}
    summary = collect_hidden_states(target, dataset, spec, output_dir, opts, source=source)
    done = "store complete" if summary["manifest"] else "other ranks still running"
    group = f" ({layout.describe()})" if layout.tp_size > 1 else ""
    print(f"rank {rank}/{world}: wrote {summary['shards_written']} shards ({summary['tokens']} tokens, "
          f"{summary['tokens_per_s']:.0f} tokens/s), skipped {summary['shards_skipped']} finished -> "
          f"{output_dir} ({done}){group}")


if __name__ == "__main__":
    check_command_line("collect", "collect_hidden_states", sys.argv[1:])  # a refused override: one line
    main()
