"""Recipe: print what a target + method + data size will cost before any of it runs.

    specheads plan target=qwen3_8b method=eagle3 plan.num_samples=500000 plan.processes=8 plan.device=cuda
    python recipes/plan.py ...            (same overrides)
"""

import json
import logging
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from specheads.data.prepare import META_FILE
from specheads.errors import ConfigError, user_errors
from specheads.overrides import check_command_line
from specheads.planning import format_plan, make_plan, target_config

log = logging.getLogger("specheads.plan")
SHAREGPT_TOKENS_PER_SAMPLE = 1350  # packaged ShareGPT rendered for SmolLM2 at max_length 2048: 21.1M tokens / 15,689 chats


def tokens_per_sample(cfg: DictConfig) -> float:
    if cfg.plan.tokens_per_sample is not None:
        return float(cfg.plan.tokens_per_sample)
    meta = Path(cfg.prepared_dir) / META_FILE
    if meta.is_file():
        m = json.loads(meta.read_text())
        if m.get("num_samples"):
            log.info("tokens per sample from %s: %d tokens / %d samples", meta, m["num_tokens"], m["num_samples"])
            return m["num_tokens"] / m["num_samples"]
    return float(SHAREGPT_TOKENS_PER_SAMPLE)


def run(cfg: DictConfig):
    device = cfg.plan.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"plan.device={device}: this machine has no CUDA device; use plan.device=cpu or auto")
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
        Path(cfg.plan.json).write_text(json.dumps(plan.to_dict(), indent=1))
    return plan


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors("plan"):
        run(cfg)


if __name__ == "__main__":
    check_command_line("plan", "plan", sys.argv[1:])  # a refused override: one line
    main()
