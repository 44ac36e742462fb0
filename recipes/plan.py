"""Recipe: print what a target + method + data size will cost before any of it runs.

    specheads plan target=qwen3_8b method=eagle3 plan.num_samples=500000 plan.processes=8 plan.device=cuda
    python recipes/plan.py ...            (same overrides)
"""

import json
import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from specheads.data.prepare import META_FILE
from specheads.data.store import canonical_dtype
from specheads.errors import ConfigError, user_errors
from specheads.hardware import resolve_device
from specheads.overrides import check_command_line
from specheads.planning import check_sizes, format_plan, make_plan, target_config

log = logging.getLogger("specheads.plan")
SHAREGPT_TOKENS_PER_SAMPLE = 1350  # packaged ShareGPT rendered for SmolLM2 at max_length 2048: 21.1M tokens / 15,689 chats


def tokens_per_sample(cfg: DictConfig) -> float:
    """The row length the plan prices: as set, else the prepared set's mean, else a target preset's
    ``data_preset.max_length`` (its longest rows: an upper bound), else ShareGPT's."""
    if cfg.plan.tokens_per_sample is not None:
        return float(cfg.plan.tokens_per_sample)
    meta = Path(cfg.prepared_dir) / META_FILE
    if meta.is_file():
        m = json.loads(meta.read_text())
        if m.get("num_samples"):
            log.info("tokens per sample from %s: %d tokens / %d samples", meta, m["num_tokens"], m["num_samples"])
            return m["num_tokens"] / m["num_samples"]
    preset = OmegaConf.select(cfg, "target.data_preset.max_length")
    if preset is not None:
        log.info("tokens per sample: the target preset's data_preset.max_length, %d (its longest rows; "
                 "plan.tokens_per_sample sets another)", preset)
        return float(preset)
    return float(SHAREGPT_TOKENS_PER_SAMPLE)


def check_config(cfg: DictConfig) -> None:
    """Every setting's range, with no file read and nothing loaded (the folders are checked when the plan starts)."""
    plan = cfg.plan
    counts = ("plan.num_samples", "plan.processes", "plan.probe_tokens", "plan.train_tokens", "collect.batch_tokens")
    sizes = {name: OmegaConf.select(cfg, name) for name in (*counts, "plan.epochs", "plan.device_gib")}
    if plan.tokens_per_sample is not None:  # null: the prepared set's mean, else ShareGPT's
        sizes["plan.tokens_per_sample"] = plan.tokens_per_sample
    check_sizes(sizes, counts)
    canonical_dtype(cfg.collect.dtype)
    if plan.get("engine") not in (None, "hf", "vllm"):
        raise ConfigError(f"plan.engine={plan.engine}: use vllm (time vLLM's collection too) or leave it null")
    resolve_device(plan.device, "plan.device")


def check_paths(cfg: DictConfig) -> None:
    """``plan.disk_dir`` names a folder (one that exists, or a relative one a stage makes under this one) and
    ``plan.json`` a file whose folder can be written, before the probe runs."""
    disk = cfg.plan.disk_dir
    if disk is not None:
        path = Path(disk).expanduser()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"plan.disk_dir={disk} is a file: give the folder the store would go to (or null)")
        if not path.exists() and path.is_absolute():
            raise ConfigError(f"plan.disk_dir={disk} does not exist: give an existing folder on the filesystem the "
                              "store would go to (its free space is compared), or null")
    if cfg.plan.json:
        out = Path(cfg.plan.json).expanduser()
        if out.is_dir():
            raise ConfigError(f"plan.json={cfg.plan.json} is a folder: give a file name, e.g. "
                              f"plan.json={out / 'plan.json'}")
        for place in out.parents:  # the nearest folder that exists takes the file (and the folders it needs)
            if place.exists():
                if not place.is_dir():
                    raise ConfigError(f"plan.json={cfg.plan.json} is inside {place}, which is a file: give a file "
                                      "name in a folder")
                if not os.access(place, os.W_OK | os.X_OK):
                    raise ConfigError(f"plan.json={cfg.plan.json}: {place} is not writable here: give a file in a "
                                      "folder you can write to")
                break


def run(cfg: DictConfig):
    check_config(cfg)
    check_paths(cfg)
    device = resolve_device(cfg.plan.device, "plan.device")
    method = OmegaConf.to_container(cfg.method, resolve=True)
    target = OmegaConf.to_container(cfg.target, resolve=True)
    config = target_config(target["name_or_path"], target.get("architecture"))
    plan = make_plan(target_name=target["name_or_path"], config=config, method_name=method.pop("name"),
                     method_settings=method, dtype=target.get("dtype", "auto"), store_dtype=cfg.collect.dtype,
                     num_samples=int(cfg.plan.num_samples), tokens_per_sample=tokens_per_sample(cfg),
                     epochs=float(cfg.plan.epochs), batch_tokens=int(cfg.collect.batch_tokens), device=device,
                     processes=int(cfg.plan.processes), device_gib=float(cfg.plan.device_gib),
                     probe_tokens=int(cfg.plan.probe_tokens), disk_dir=cfg.plan.disk_dir,
                     train_tokens=int(cfg.plan.train_tokens), engine=cfg.plan.get("engine"),
                     engine_python=cfg.plan.get("engine_python"))
    print(format_plan(plan))
    if cfg.plan.json:
        out = Path(cfg.plan.json).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(plan.to_dict(), indent=1))
    return plan


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors("plan"):
        run(cfg)


if __name__ == "__main__":
    check_command_line("plan", "plan", sys.argv[1:])  # a refused override: one line
    main()
