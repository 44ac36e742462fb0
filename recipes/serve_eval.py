"""Recipe: serve an exported head in a real engine (vLLM) and measure it on the evaluation prompts.

    bash scripts/setup_engine.sh       # once: vLLM's CPU build in .venv-vllm
    python recipes/serve_eval.py export_dir=runs/x/export/eagle3/vllm [eval_report=runs/x/eval/eagle3/report.json]
    specheads serve-eval engine=endpoint url=http://127.0.0.1:8000 plain_url=http://127.0.0.1:8001 export_dir=...
    specheads serve-eval ...           (same overrides)

Everything the user gives is checked (the export, the engine's python, the evaluation report, the prompts)
before an engine starts; a refusal or a missing engine is one line (specheads.errors.UserError).
"""

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specheads.errors import ConfigError, check_output_folder, user_errors
from specheads.overrides import check_command_line
from specheads.evaluation.prompts import BenchmarkSpec, load_benchmarks

log = logging.getLogger("specheads.serve_eval")


@dataclass
class VllmSchema:
    python: Optional[str] = None
    threads_bind: Optional[str] = None
    kv_cache_gib: Optional[int] = 1
    dtype: Optional[str] = "float32"
    max_model_len: Optional[int] = 2048
    enforce_eager: bool = False
    timeout_s: float = 1800


@dataclass
class ServeEvalSchema:
    target: Any = MISSING
    eval: Any = MISSING
    engine: str = "offline"
    vllm: VllmSchema = field(default_factory=VllmSchema)
    export_dir: Optional[str] = None
    output_dir: str = "runs/default/serve_eval"
    num_speculative_tokens: Any = "auto"
    eval_report: Optional[str] = None
    same_prompts: bool = True
    plain: bool = True
    url: Optional[str] = None
    plain_url: Optional[str] = None
    head_method: Optional[str] = None


ConfigStore.instance().store(name="serve_eval_schema", node=ServeEvalSchema)


def prompt_set(cfg: DictConfig):
    ev = OmegaConf.to_container(cfg.eval, resolve=True)
    for key in ("max_new_tokens", "repeats", "max_minutes"):
        ev.pop(key, None)
    ev["mtbench_turns"] = tuple(ev["mtbench_turns"])
    try:
        return load_benchmarks(BenchmarkSpec(**ev))
    except ValueError as e:
        raise ConfigError(f"eval: {e}") from None


def check_config(cfg: DictConfig) -> None:
    """Every setting's value, with no file read (``specheads run`` calls it before its first stage)."""
    from specheads.ranges import check_choice, check_number

    if str(cfg.num_speculative_tokens) != "auto":
        check_number("num_speculative_tokens", cfg.num_speculative_tokens, ">= 1", integer=True,
                     note="or auto: the chain the evaluation report's shape choice favours, else 3")
    if cfg.engine not in ("offline", "endpoint"):
        raise ConfigError(f"engine={cfg.engine}: use engine=offline (vLLM started here) or engine=endpoint (url=)")
    for name in ("url", "plain_url"):
        url = cfg.get(name)
        if url is not None and not str(url).startswith(("http://", "https://")):
            raise ConfigError(f"{name}={url}: give the server's base url, e.g. {name}=http://127.0.0.1:8000")
    if cfg.engine == "endpoint" and not cfg.url:
        raise ConfigError("engine=endpoint needs url=: the base url of the vLLM server that drafts with the head "
                          "(e.g. url=http://127.0.0.1:8000)")
    check_number("vllm.max_model_len", cfg.vllm.max_model_len, "?>= 1", integer=True,
                 note="null = the target's own context length")
    check_number("vllm.kv_cache_gib", cfg.vllm.kv_cache_gib, "?>= 1", integer=True)
    check_number("vllm.timeout_s", cfg.vllm.timeout_s, "> 0")
    check_choice("vllm.dtype", cfg.vllm.dtype, ("auto", "float32", "bfloat16", "float16"))
    check_number("eval.max_new_tokens", cfg.eval.max_new_tokens, ">= 1", integer=True)


@hydra.main(config_path="../conf", config_name="serve_eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors("serve-eval"):
        run(cfg)


def run(cfg: DictConfig) -> dict:
    from specheads.serving import serve_eval as se
    from specheads.serving.engine import read_export
    from specheads.targets import load_tokenizer

    check_config(cfg)
    check_output_folder(cfg.output_dir)
    head = read_export(cfg.export_dir) if cfg.export_dir else None
    if head is None and cfg.engine == "offline":
        raise ConfigError("export_dir is required: give a layout folder `specheads export` wrote, "
                          "e.g. export_dir=runs/quickstart/export/eagle3/vllm")
    drafter = head.method if head else cfg.head_method
    drafter = "medusa" if str(drafter).startswith("medusa") else drafter
    eval_report = se.read_eval_report(cfg.eval_report) if cfg.eval_report else None
    k, why = se.chain_length(cfg.num_speculative_tokens, eval_report, drafter)
    log.info("a chain of %d: %s", k, why)
    prompts = prompt_set(cfg)
    if eval_report is not None and cfg.same_prompts:
        scored = se.report_prompts(prompts, eval_report, cfg.eval_report)
        if scored is None:
            log.warning("the evaluation report does not list its prompts (evaluate again to record them): decoding "
                        "every prompt of the eval.* settings")
        prompts = scored or prompts
    if eval_report is not None and eval_report.get("num_prompts") != len(prompts):
        log.warning("the evaluation report scored %s prompts, this run %d: give the same eval.* settings for a "
                    "comparison on the same prompts", eval_report.get("num_prompts"), len(prompts))
    tokenizer = load_tokenizer(cfg.target.name_or_path, cfg.target.get("chat_template"))
    max_new = int(cfg.eval.max_new_tokens)
    kwargs = OmegaConf.to_container(cfg.target.chat_template_kwargs, resolve=True) \
        if cfg.target.get("chat_template_kwargs") else {}
    if cfg.engine == "endpoint":
        runs, context = _endpoint(cfg, prompts, tokenizer, max_new, kwargs)
    else:
        runs, context = _offline(cfg, head, k, prompts, tokenizer, max_new, kwargs)
    context.update(chain_choice=why, method=drafter, export_dir=str(head.folder) if head else None, max_new_tokens=max_new,
                   head_source=(head.info.get("foreign") or "specheads") if head else None)
    report = se.build_report(runs, k, context, eval_report, drafter)
    paths = se.write_report(report, cfg.output_dir)
    print(Path(paths["markdown"]).read_text())
    print(f"report -> {paths['json']}, {paths['markdown']}")
    return report


def check_context_length(max_model_len: int | None, model) -> None:
    """Refuse a ``vllm.max_model_len`` over the target's own context length (its config.json's
    ``max_position_embeddings``) before the engine starts: vLLM refuses it only in its own log."""
    config = Path(model) / "config.json"
    if not max_model_len or not config.is_file():
        return
    facts = json.loads(config.read_text())
    limit = facts.get("max_position_embeddings") or (facts.get("text_config") or {}).get("max_position_embeddings")
    if limit and max_model_len > int(limit):
        raise ConfigError(f"vllm.max_model_len={max_model_len} is over the target's context length ({limit}, "
                          f"max_position_embeddings of {config}): give vllm.max_model_len={limit} or less")


def vision_refusal(engine, model) -> str | None:
    """The one line refusing a vision-language ``model`` (a local folder whose config.json has a vision part) to an
    engine whose python cannot import torchvision (``engine_process.torchvision_missing``), or None: without it
    vLLM's VL model classes fail to import and vLLM reports only that the model's architectures "failed to be
    inspected", deep in its start-up. serve-eval's own check: an engine process does not make it."""
    from types import SimpleNamespace

    from specheads import engine_process
    from specheads.targets.model import is_vision_language

    try:
        facts = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(facts, dict) or not is_vision_language(SimpleNamespace(**facts)):
        return None
    if (lacking := engine_process.torchvision_missing(engine.python)) is None:
        return None
    missing, torch_version = lacking
    torch = f"its torch {torch_version}" if torch_version else "its torch"
    return (f"the target {model} is a vision-language model and the engine's python ({engine.python}) cannot import "
            f"torchvision ({engine_process.first_line(missing, 120)}), which vLLM {engine.version}'s vision-language "
            f"model classes import: install the CPU torchvision built for {torch} into the engine's venv from "
            "PyTorch's CPU wheel index (its whl/cpu index, pip install torchvision==<that version> --index-url <it>), "
            "or serve on a GPU node whose vLLM has it; `specheads evaluate` measures the head meanwhile")


def _offline(cfg, head, k, prompts, tokenizer, max_new, template_kwargs):
    from specheads.serving import serve_eval as se
    from specheads.engine_process import start_engines
    from specheads.serving.engine import (EngineRefusedError, engine_settings, find_engine, model_engine_kwargs,
                                          speculative_config)
    from specheads.targets import resolve_target_path

    model = head.adapted_target or resolve_target_path(cfg.target.name_or_path)
    check_context_length(cfg.vllm.max_model_len, model)
    engine = find_engine(cfg.vllm.python)
    env = engine_settings(engine, cfg.vllm.threads_bind, cfg.vllm.kv_cache_gib)
    log.info("vLLM %s (%s: %s); settings %s", engine.version, engine.found, engine.python, env)
    base = {"model": str(model), "tokenizer": str(model), "dtype": cfg.vllm.dtype,
            "max_model_len": cfg.vllm.max_model_len, "seed": 0,
            "engine_kwargs": {**({"enforce_eager": True} if cfg.vllm.enforce_eager else {}),
                              **model_engine_kwargs(model)}}
    out = Path(cfg.output_dir)
    names = ("plain", "spec") if cfg.plain else ("spec",)
    procs, started, logs = {}, {}, {}
    try:
        if refusal := vision_refusal(engine, model):  # after the engine is found, before any engine starts
            raise EngineRefusedError(refusal)
        logs = {name: str(out / f"engine_{name}.log") for name in names}  # the engines that start
        configs = {name: (dict(base, speculative_config=speculative_config(head, k) if name == "spec" else None),
                          logs[name]) for name in names}
        log.info("starting the engines side by side (%s): logs %s", ", ".join(names), ", ".join(logs.values()))
        t = time.perf_counter()
        procs = start_engines(engine, configs, env, cfg.vllm.timeout_s)
        started = {"load_s": {name: round(p.load_s, 1) for name, p in procs.items()},
                   "load_wall_s": {name: round(p.wall_load_s, 1) for name, p in procs.items()},
                   "start_wall_s": round(time.perf_counter() - t, 1)}
        log.info("engines ready in %s s (loads %s)", started["start_wall_s"], started["load_s"])
        decoders = {name: se.EngineDecoder(p) for name, p in procs.items()}
        runs = se.decode_prompts(prompts, tokenizer, decoders["spec"], max_new, decoders.get("plain"), template_kwargs,
                                 progress=log.info)
    except EngineRefusedError as refused:  # recorded: the report says which engine refused the head, and why
        se.write_report(se.refusal_report(str(refused), {
            "engine": {"name": "vLLM", "version": engine.version, "python": engine.python, "env": env, "logs": logs},
            "method": head.method, "export_dir": str(head.folder), "target": str(model), "dtype": cfg.vllm.dtype,
            "speculative_config": speculative_config(head, k)}, k), out)
        raise
    finally:
        for p in procs.values():
            p.close()
    context = {"engine": {"name": "vLLM", "version": engine.version, "mode": "offline (LLM API, one process per "
                          "engine; the engines load side by side)", "python": engine.python, "found": engine.found,
                          "env": env, **started, "logs": logs},
               "target": str(model), "dtype": cfg.vllm.dtype,
               "speculative_config": speculative_config(head, k)}
    return runs, context


def _endpoint(cfg, prompts, tokenizer, max_new, template_kwargs):
    from specheads.serving import serve_eval as se
    from specheads.serving.endpoint import EndpointDecoder

    spec = EndpointDecoder(cfg.url, timeout_s=cfg.vllm.timeout_s)
    plain = EndpointDecoder(cfg.plain_url, timeout_s=cfg.vllm.timeout_s) if cfg.plain and cfg.plain_url else None
    if cfg.plain and not cfg.plain_url:
        log.warning("no plain_url: no plain decoding to compare with (greedy identity and speed-up left out)")
    runs = se.decode_prompts(prompts, tokenizer, spec, max_new, plain, template_kwargs, progress=log.info)
    context = {"engine": {"name": "vLLM", "version": "(server)", "mode": "endpoint", "url": spec.url,
                          "plain_url": plain.url if plain else None, "env": None},
               "target": spec.model, "dtype": "(the server's)"}
    return runs, context


if __name__ == "__main__":
    check_command_line("serve-eval", "serve_eval", sys.argv[1:])  # a refused override: one line
    main()
