"""Run logs: wandb (offline by default), ``metrics.jsonl`` and a progress bar, on the main process only."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specheads.progress import training_bar_format, training_position, training_postfix
from specheads.training.config import TrainConfig

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "train_summary.json"


class RunLogger:
    """wandb (main process; offline unless told otherwise), ``metrics.jsonl`` and a tqdm bar."""

    def __init__(self, cfg: TrainConfig, out: Path, accelerator, method_name: str, start_step: int):
        self.main = accelerator.is_main_process
        self.run = self.bar = None
        self.jsonl = out / METRICS_FILE
        if not self.main:
            return
        _truncate_jsonl(self.jsonl, start_step)
        mode = os.environ.get("WANDB_MODE", cfg.wandb_mode)
        if mode != "disabled":
            self.run = _init_wandb(cfg, out, mode, method_name)
        self.max_steps, self.budget_s = cfg.max_steps, 60 * cfg.max_minutes if cfg.max_minutes else None
        if cfg.progress:  # under a time budget the bar counts its minutes (specheads.progress)
            from tqdm.auto import tqdm

            start = training_position(start_step, cfg.max_steps, 0.0, self.budget_s)  # the clock comes with a step
            self.bar = tqdm(total=start.total, initial=0 if self.budget_s else start.done, desc=f"train {method_name}",
                            dynamic_ncols=True, bar_format=training_bar_format(self.budget_s))

    def log(self, step: int, record: dict[str, float], to_wandb: bool = True) -> None:
        if not self.main:
            return
        clean = {k: v for k, v in record.items() if not k.startswith("_")}
        with open(self.jsonl, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.run is not None and to_wandb:
            self.run.log(clean, step=step)

    def progress(self, step: int, loss: float | None, lr: float | None, train_s: float) -> None:
        if self.bar is not None:
            pos = training_position(step, self.max_steps, train_s, self.budget_s)
            self.bar.total, self.bar.n = pos.total, pos.done
            self.bar.set_postfix_str(training_postfix(pos, step, loss, lr))  # refreshes the bar

    def end_progress(self) -> None:
        """Close the bar (the loop is over), so what follows logs on lines of its own."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self.end_progress()
        if self.run is not None:
            if summary:
                self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
            self.run.finish()


def _init_wandb(cfg: TrainConfig, out: Path, mode: str, method_name: str):
    import wandb

    id_file = out / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    id_file.write_text(run_id)
    return wandb.init(project=cfg.wandb_project, name=cfg.run_name or f"{method_name}-{out.name}", id=run_id,
                      resume="allow", mode=mode, dir=str(out), config={"train": asdict(cfg), "method": method_name})


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records past the step we resume from (they came from the killed run)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last_step]
    path.write_text("".join(ln + "\n" for ln in keep))


def read_train_summary(head_dir: str | Path | None) -> dict | None:
    """A run's ``train_summary.json``, given its output folder or the ``head/`` folder in it (None if none)."""
    if not head_dir:
        return None
    for d in (Path(head_dir), Path(head_dir).parent):
        if (d / SUMMARY_FILE).is_file():
            return json.loads((d / SUMMARY_FILE).read_text())
    return None


def read_losses(output_dir: str | Path) -> dict[int, float]:
    """Step -> training loss from a run's ``metrics.jsonl``."""
    out = {}
    for ln in (Path(output_dir) / METRICS_FILE).read_text().splitlines():
        rec = json.loads(ln)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out
