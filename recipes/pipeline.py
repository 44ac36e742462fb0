"""Recipe: the whole job (prepare -> collect -> train -> evaluate -> export), each stage in its own process.

    specheads run [head=medusa1] [run_dir=runs/x] [stages.train='[train.max_steps=500]']
"""

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("specheads.run")
# Stages run as modules (`python -m specheads.recipes.<stage>`), found through the installed package
# (a clone's editable install or site-packages) and run in the current directory.
RECIPES_PACKAGE = "specheads.recipes"


def stage_commands(cfg: DictConfig) -> list[tuple[str, str, list[str]]]:
    """(stage, recipe file, overrides) in order; every path lives under run_dir."""
    run = Path(cfg.run_dir)
    target = [f"target.{k}={v}" for k, v in cfg.target.items()]
    prepared, features = run / "prepared", run / "features"
    train_out, report = run / "train" / cfg.head, run / "eval" / cfg.head
    data = ([f"features_dir={features}"] if cfg.offline else [f"prepared_dir={prepared}"])
    eval_method = "medusa" if cfg.head.startswith("medusa") else cfg.head
    stages = [
        ("prepare", "prepare_data.py", [f"output_dir={prepared}"]),
        ("collect", "collect_hidden_states.py",
         [f"prepared_dir={prepared}", f"out_dir={features}", f"method={cfg.head}"]),
        ("train", "train.py", [f"method={cfg.head}", f"output_dir={train_out}", f"prepared_dir={prepared}", *data]),
        ("evaluate", "evaluate.py", [f"head_method={eval_method}", f"head_dir={train_out}",
                                     f"eval.chat_dir={prepared}", f"output_dir={report}"]),
        ("export", "export.py", [f"head_dir={train_out / 'head'}", f"out_dir={run / 'export' / cfg.head}",
                                 f"eval_report={report / 'report.json'}", f"training_data={prepared}", "overwrite=true"]),
    ]
    if not cfg.offline:
        stages = [s for s in stages if s[0] != "collect"]
    extra = {name: list(cfg.stages[name]) for name, _, _ in stages}
    extra["train"] += list(cfg.head_overrides.get(cfg.head, []))
    return [(name, recipe, target + args + extra[name]) for name, recipe, args in stages]


def run_stage(name: str, recipe: str, overrides: list[str], done_dir: Path) -> None:
    marker = done_dir / f"{name}.json"
    if marker.exists() and json.loads(marker.read_text()).get("overrides") == overrides:
        log.info("[%s] finished earlier with the same settings; skipping", name)
        return
    log.info("[%s] %s %s", name, recipe, " ".join(overrides))
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", f"{RECIPES_PACKAGE}.{Path(recipe).stem}", *overrides])
    if res.returncode != 0:
        raise SystemExit(f"specheads run: stage '{name}' failed (exit {res.returncode}); fix the cause and "
                         "re-run the same command: finished stages are skipped, this one resumes")
    done_dir.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"overrides": overrides, "seconds": round(time.time() - t0, 1)}))
    tmp.replace(marker)
    log.info("[%s] done in %.0f s", name, time.time() - t0)


@hydra.main(config_path="../conf", config_name="pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    t0 = time.time()
    done_dir = Path(cfg.run_dir) / ".done"
    for name, recipe, overrides in stage_commands(cfg):
        if cfg.only in (None, name):
            run_stage(name, recipe, overrides, done_dir)
    report = Path(cfg.run_dir) / "eval" / cfg.head / "report.md"
    if report.exists():
        print(report.read_text())
    log.info("pipeline finished in %.1f min; run folder: %s", (time.time() - t0) / 60, cfg.run_dir)
    OmegaConf.save(cfg, Path(cfg.run_dir) / "pipeline.yaml")


if __name__ == "__main__":
    main()
