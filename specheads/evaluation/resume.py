"""An interrupted evaluation continues where it stopped, nothing finished decoded twice.

``suite.evaluate`` keeps its plain pass and each finished method row in ``<output_dir>/evaluate_state.bin``,
written atomically after each and checked by a SHA-256 of its contents. A re-run takes them up when it would
evaluate the same thing: the same settings and prompts, the same target (name, dtype, device, parameters), the
same head files (sizes and modification times), and the same decisions measured on the machine (cpu linear
layout, threads, row floor and its proof, attention). Anything else starts over, with the reason in the log:
other settings, a head trained again in place, a decision measured differently now, a damaged or foreign file.
The report names the methods that were taken up (``resumed``). A finished evaluation removes the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STATE_FILE = "evaluate_state.bin"
FORMAT = "specheads.evaluate_state/2"  # 2: the fast and exact passes (passes.py)
# what evaluate measures on the machine and every row depends on: a resumed evaluation must measure the same
EXACT_DECISIONS = ("attention", "row_floor", "row_chunk", "row_form", "proven", "packed_linears", "fallback")


@dataclass
class EvalState:
    """What an evaluation has finished: its plan, the plain pass (``ids``: prompt and answer token ids; ``plain``:
    the timed plain runs per temperature), the report so far, the shapes chosen for automatic-shape heads, and how
    many of the methods (in order) are done."""

    key: str
    plan: Any
    ids: dict
    plain: dict
    report: dict
    chosen: dict
    done: int


def evaluation_key(cfg, target) -> str:
    """A digest of what the evaluation computes: its settings (methods and prompt set included), the target and
    the files of each head (a head trained again in the same folder is another head)."""
    heads = sorted({str(m.head_dir) for m in cfg.methods if getattr(m, "head_dir", None)})
    facts = {"config": repr(cfg), "target": [str(target.name), str(target.dtype), str(target.device),
                                             sum(p.numel() for p in target.model.parameters())],
             "heads": {h: _files(h) for h in heads}}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def decisions(report: dict) -> dict:
    """The choices measured on the machine that every row of ``report`` was decoded under."""
    exact = report.get("exact_forward") or {}
    return {"target_dtype": report.get("target_dtype"),
            "cpu_linears": (report.get("cpu_linears") or {}).get("linears"),
            "cpu_threads": (report.get("cpu_threads") or {}).get("threads"),
            "fast_attention": ((report.get("passes") or {}).get("fast") or {}).get("attention"),
            **{f"exact.{k}": exact.get(k) for k in EXACT_DECISIONS}}


class EvalResume:
    """The state file of the evaluation writing to ``folder``."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / STATE_FILE

    def load(self, key: str) -> EvalState | None:
        """The state an interrupted evaluation of ``key`` left, or None (none, another evaluation's, damaged)."""
        if not self.path.is_file():
            return None
        try:
            raw = self.path.read_bytes()
            header, _, payload = raw.partition(b"\n")
            meta = json.loads(header)
            if meta.get("format") != FORMAT or meta.get("sha256") != hashlib.sha256(payload).hexdigest():
                raise ValueError("its checksum or format does not match")
            state = pickle.loads(payload)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is not trusted
            log.warning("%s is damaged (%s): the evaluation starts over", self.path, e)
            return None
        if not isinstance(state, EvalState) or state.key != key:
            log.info("%s was left by an evaluation of other settings, target or heads: starting over", self.path)
            return None
        return state

    def save(self, state: EvalState) -> None:
        payload = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        header = json.dumps({"format": FORMAT, "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(header + b"\n" + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def _files(head_dir: str) -> list:
    """(name, size, modification time) of each file of a head folder and of its ``head/`` folder."""
    root = Path(head_dir).expanduser()
    found = []
    for folder in (root, root / "head"):
        if folder.is_dir():
            for f in sorted(folder.iterdir()):
                if f.is_file():
                    st = f.stat()
                    found.append([str(f.relative_to(root)), st.st_size, st.st_mtime_ns])
    return found
