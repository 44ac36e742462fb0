"""Recipe: a trained head folder -> Hub folder(s) that vLLM / SGLang load as they are.

    python recipes/export.py head_dir=runs/x/train/eagle3/head output_dir=runs/x/export [engine=vllm] \
        [target_id=org/model]
    specheads export ...            (same overrides)
"""

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from specheads.errors import renamed_setting, user_errors
from specheads.overrides import check_command_line
from specheads.export import export_head
from specheads.export.export import check_request
from specheads.export.serve import exported_lines

log = logging.getLogger("specheads.export")


@dataclass
class ExportRecipeConfig:
    target: Any = MISSING
    head_dir: str = MISSING
    output_dir: str = MISSING
    out_dir: Optional[str] = None  # the former name of output_dir: still read, with a warning
    engine: str = "all"
    eval_report: Optional[str] = "auto"
    training_data: Optional[str] = None
    dtype: Optional[str] = None
    spec_tokens: Optional[int] = None
    overwrite: bool = False
    push_to_hub: Optional[str] = None
    target_id: Optional[str] = None
    hub_private: bool = True
    push_dry_run: bool = False


ConfigStore.instance().store(name="export_schema", node=ExportRecipeConfig)


def check_config(cfg: DictConfig) -> None:
    """Every setting's value, with no file read (``specheads run`` calls it before its first stage)."""
    check_request(cfg.engine, cfg.dtype, cfg.spec_tokens)


def run(cfg: DictConfig) -> str:
    log.info("exporting %s for %s: reading the head and the target, writing and re-checking each layout",
             cfg.head_dir, cfg.engine)
    output_dir = renamed_setting("export", "out_dir", "output_dir", cfg.out_dir) or cfg.output_dir
    path = export_head(cfg.head_dir, output_dir, engine=cfg.engine, target=cfg.target.name_or_path,
                       eval_report=cfg.eval_report, data=cfg.training_data, dtype=cfg.dtype, spec_tokens=cfg.spec_tokens,
                       overwrite=cfg.overwrite, push_to_hub=cfg.push_to_hub, target_id=cfg.target_id,
                       hub_private=cfg.hub_private, push_dry_run=cfg.push_dry_run,
                       chat_template=cfg.target.get("chat_template"))
    lines = exported_lines(path, cfg.target_id or (cfg.target.name_or_path
                                                   if Path(cfg.target.name_or_path).expanduser().is_dir() else None))
    print(f"exported {cfg.head_dir} -> {path} (model card: README.md in each engine folder)\n\n"
          "Serve it from here (draft settings: the evaluation's recommendation for GPU serving, when a report was "
          "given):\n\n" + "\n".join(f"  {line}" for line in lines))
    return str(path)


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors("export"):
        run(cfg)


if __name__ == "__main__":
    check_command_line("export", "export", sys.argv[1:])  # a refused override: one line
    main()
