"""How much of a prepared set a collection time budget covers: rows in order until the budget, from a
measured rate.

``collect.max_minutes`` turns collection from "every prepared row" into "the prepared rows, in their order,
that this machine collects in that many minutes": the same command fits its time on a slow CPU and keeps the
whole set on a fast one. The rate comes from timed forwards of the target on rows like the collection's
(``measure_rate``); the decision is written to ``budget.json`` in the store before any shard, so a re-run
(after a kill) keeps the same rows, the same shard plan and the shards already written, and every process of
a several-process collection reads the one decision of the first (``decide``). The store's metadata says it
is partial by design (``source.budget``); later stages read the rows it holds.

The rate is measured once, before the collection; a machine that slows down afterwards (another job
starting beside it) would carry the collection past its budget. A single-process collection therefore
stops ``OVERRUN`` times its budget after it began and keeps the rows it collected (``cut``): shards are
collected shortest rows first, so the rows kept are the shortest of the budget's; ``budget.json`` records
them, and a re-run keeps exactly that store.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

from specheads.data.store import PLAN, StoreMismatchError, atomic_write_json
from specheads.errors import UserError

log = logging.getLogger(__name__)

BUDGET_FILE = "budget.json"
WAIT_S = 1800  # how long a process waits for the first process's decision
OVERRUN = 1.15  # a single-process collection is cut this many times its budget after it began


def rows_within(lengths: Sequence[int], tokens: float) -> int:
    """How many rows, taken in order, hold at most ``tokens`` tokens (at least one row)."""
    total = 0
    for n, length in enumerate(lengths):
        total += length
        if total > tokens:
            return max(n, 1)
    return len(lengths)


def measure_rate(forward: Callable[[list[int]], int], lengths: Sequence[int], batch_tokens: int,
                 probe_tokens: int = 2048, runs: int = 3) -> float:
    """Tokens per second of ``forward`` (runs the target on rows ``indices``, returns the padded tokens it
    ran): rows of the middle length, about ``min(probe_tokens, batch_tokens)`` padded tokens, run once to warm
    up, then ``runs`` timed runs of which the fastest counts (a shared machine's pauses only ever slow a run
    down: on one, a single timed run read 80 tokens/s where the collection then ran at 223)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    mid = len(order) // 2
    want = max(1, min(probe_tokens, batch_tokens))
    rows = [order[mid]]
    while mid + len(rows) < len(order) and (len(rows) + 1) * lengths[order[mid + len(rows)]] <= want:
        rows.append(order[mid + len(rows)])
    forward(rows)  # warm-up: first-touch, kernel choice
    best = 0.0
    for _ in range(max(runs, 1)):
        t0 = time.perf_counter()
        ran = forward(rows)
        best = max(best, ran / max(time.perf_counter() - t0, 1e-9))
    return best


def decide(root: str | Path, lengths: Sequence[int], max_minutes: float, processes: int, first: bool,
           rate: Callable[[], float]) -> dict:
    """The budget's decision for the store at ``root``: ``{"rows", "prepared_rows", "tokens", "max_minutes",
    "tokens_per_s", "processes"}``. An existing ``budget.json`` of the same budget and prepared set is kept
    (a resumed collection); otherwise the first process (``first``) measures ``rate()`` and writes it, and the
    others wait for that file."""
    root = Path(root)
    path = root / BUDGET_FILE
    deadline = time.monotonic() + WAIT_S
    while True:
        old = _read(path)
        if old is not None and old.get("max_minutes") == max_minutes and old.get("prepared_rows") == len(lengths):
            log.info("collection budget: %d of %d prepared rows (%s), as decided when this store was begun",
                     old["rows"], old["prepared_rows"], _describe(old))
            return old
        if first:
            break
        if time.monotonic() > deadline:
            raise UserError(f"waited {WAIT_S} s for the first process to write {path}; is it running?")
        time.sleep(1.0)
    if old is not None and (root / PLAN).exists():
        raise StoreMismatchError(
            f"{root} was begun under another budget or prepared set ({old.get('max_minutes')} min, "
            f"{old.get('prepared_rows')} rows; now {max_minutes} min, {len(lengths)} rows): collect into a new "
            f"output_dir or delete {root}")
    per_s = rate()
    rows = rows_within(lengths, per_s * max_minutes * 60 * processes)
    decision = {"rows": rows, "prepared_rows": len(lengths), "tokens": int(sum(lengths[:rows])),
                "max_minutes": max_minutes, "tokens_per_s": round(per_s, 1), "processes": processes}
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, decision)
    log.info("collection budget: %d of %d prepared rows (%s)", rows, len(lengths), _describe(decision))
    return decision


def cut(root: str | Path, decision: dict, kept_rows: Sequence[int], tokens: int, from_plan: str,
        to_plan: str) -> dict:
    """Record that the collection stopped at its deadline keeping the prepared rows ``kept_rows``; the store's
    plan ``from_plan`` becomes ``to_plan`` (the same finished shards, fewer rows). Written before the store
    changes, so a collection killed halfway through the change completes it on its re-run."""
    decision = {**decision, "cut": {"rows": len(kept_rows), "tokens": int(tokens), "kept_rows": list(kept_rows),
                                    "overrun": OVERRUN, "from_plan": from_plan, "to_plan": to_plan}}
    atomic_write_json(Path(root) / BUDGET_FILE, decision)
    log.warning("collection passed %.2fx its %g-minute budget: cut to the %d of %d rows collected (%d tokens); "
                "%s records it", OVERRUN, decision["max_minutes"], len(kept_rows), decision["rows"], tokens,
                Path(root) / BUDGET_FILE)
    return decision


def _describe(d: dict) -> str:
    whole = "the whole set" if d["rows"] == d["prepared_rows"] else "partial by design"
    cut = (f"; cut at its deadline to {d['cut']['rows']} rows ({d['cut']['tokens']} tokens)"
           if d.get("cut") else "")
    return (f"{d['tokens']} tokens for {d['max_minutes']:g} min at ~{d['tokens_per_s']:.0f} tokens/s per process "
            f"x {d['processes']}: {whole}{cut}")


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s); deciding again", path, e)
        return None
    return data if isinstance(data, dict) and isinstance(data.get("rows"), int) else None
