"""`specheads <verb> [hydra overrides...]`: each verb runs the recipe of the same stage.

    specheads prepare data.num_samples=200
    specheads collect method=eagle3
    specheads train method=eagle3
    specheads evaluate
    specheads export
    specheads plan target=qwen3_8b plan.num_samples=500000   # store bytes, memory per layout, time, before any run
    specheads serve-eval export_dir=runs/quickstart/export/eagle3/vllm   # the head in vLLM (bash scripts/setup_engine.sh)
    specheads run            # the whole pipeline on the embedded default (see recipes/pipeline.py)
    specheads record runs/quickstart/run_summary.json --into results.json   # keep a run's report, commit, machine
    specheads --conf-dir     # where the shipped Hydra configs are (e.g. conf/launcher/*.yaml for accelerate)

Each verb runs the module ``specheads.recipes.<recipe>``, as ``python -m specheads.recipes.<recipe>``
would, from any directory; outputs go under the current directory.
"""

from __future__ import annotations

import difflib
import importlib.util
import runpy
import sys
from pathlib import Path

from specheads import paths

VERBS = {
    "prepare": "prepare_data.py",
    "collect": "collect_hidden_states.py",
    "train": "train.py",
    "evaluate": "evaluate.py",
    "export": "export.py",
    "run": "pipeline.py",
    "plan": "plan.py",
    "serve-eval": "serve_eval.py",
}
def record_main(argv: list[str]) -> None:
    """``specheads record FILE``: append FILE's measurement to a checkout's docs/benchmarks.json
    (``specheads.record``)."""
    import argparse

    from specheads.errors import user_errors
    from specheads.record import checkout_state, record

    ap = argparse.ArgumentParser(prog="specheads record", description=(
        "Keep a history of your runs: append one run's report to a results file (JSON, newest first), stamped "
        "with the commit of the code that ran (and whether its tree was dirty), the date, the machine and, for a "
        "run_summary.json, the run's settings, so that runs on other commits, machines or settings can be "
        "compared later. It reads a run_summary.json (specheads run), a serve_report.json (specheads "
        "serve-eval), a pytest log (its closing 'N passed ... in X s' line), the output of "
        "scripts/check_engine_loaders.py or the --json report of a benchmark script (scripts/bench/, scripts/peers/). "
        "How-to: docs/install.md, 'Keeping a record of your runs'."))
    ap.add_argument("file", help="the output to record")
    ap.add_argument("--checkout", default=".", help="the git checkout that was measured (default: here)")
    ap.add_argument("--into", default=None, help="the results file, started if it does not exist yet (default: "
                    "CHECKOUT/docs/benchmarks.json, the project's own record, which must exist)")
    ap.add_argument("--wall-s", type=float, default=None, help="a test log's whole command, set-up included, in s")
    ap.add_argument("--run", default=None, help="the command that was measured, as the tables should show it")
    ap.add_argument("--what", default=None, help="one line on what ran (the history table's 'what ran')")
    ap.add_argument("--machine", default=None, help="the machine in words (default: this CPU's description)")
    ap.add_argument("--fresh-clone", action="store_true", default=None, help="the checkout was a clean clone")
    ap.add_argument("--date", default=None, help="YYYY-MM-DD (default: today)")
    args = ap.parse_args(argv)
    with user_errors("record"):
        entry = record(args.file, args.into or Path(args.checkout) / "docs" / "benchmarks.json",
                       checkout_state(args.checkout), wall_s=args.wall_s, machine=args.machine, date=args.date,
                       run=args.run, what=args.what, fresh_clone=args.fresh_clone, new_ok=args.into is not None)
    dirty = " (dirty tree)" if entry["dirty"] else ""
    print(f"recorded a {entry['kind']} entry: {entry['date']}, commit {entry['commit'][:7]}{dirty}, {entry['machine']}")


NOT_HYDRA = {"record": record_main}  # verbs with plain options and no recipe


def recipes_dir() -> Path:
    try:
        return paths.recipes_dir()
    except RuntimeError as e:
        raise SystemExit(f"specheads: {e}") from None


def group_choices(config_name: str) -> dict[str, list[str]]:
    """The config groups a recipe's primary config picks from (its defaults list) and each one's options
    (the yaml files of ``conf/<group>/``)."""
    from omegaconf import OmegaConf

    conf = paths.conf_dir()
    groups = {}
    for entry in OmegaConf.load(conf / f"{config_name}.yaml").get("defaults", []):
        if isinstance(entry, str) or len(entry) != 1:
            continue
        (group,) = entry
        if not str(group).startswith("override ") and (conf / str(group)).is_dir():
            groups[str(group)] = sorted(f.stem for f in (conf / str(group)).glob("*.yaml"))
    return groups


def check_group_choices(verb: str, overrides: list[str]) -> None:
    """One line, exit status 2, for ``group=option`` naming no option of that group (``method=nonsense``),
    before the recipe starts: Hydra's own message spans a dozen lines and its search path."""
    try:
        groups = group_choices(Path(VERBS[verb]).stem)
    except (RuntimeError, OSError):
        return  # no conf/ to read: Hydra says what is missing
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key in groups and value not in groups[key]:
            print(f"specheads {verb}: error: {key}={value}: no {key} named '{value}'; choose one of: "
                  f"{', '.join(groups[key])} (the files of conf/{key}/)", file=sys.stderr)
            raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("verbs: " + ", ".join([*VERBS, *NOT_HYDRA]))
        raise SystemExit(0 if argv else 2)
    if argv[0] == "--conf-dir":
        try:
            print(paths.conf_dir())
        except RuntimeError as e:
            raise SystemExit(f"specheads: {e}") from None
        raise SystemExit(0)
    verb, overrides = argv[0], argv[1:]
    if verb in NOT_HYDRA:
        NOT_HYDRA[verb](overrides)
        raise SystemExit(0)
    if verb not in VERBS:
        near = difflib.get_close_matches(verb, [*VERBS, *NOT_HYDRA], n=1)
        print(f"specheads: error: unknown verb '{verb}'" + (f"; did you mean {near[0]}?" if near else "")
              + f" (the verbs: {', '.join([*VERBS, *NOT_HYDRA])})", file=sys.stderr)
        raise SystemExit(2)
    recipes_dir()  # a clear message when specheads.recipes is missing (an install older than the packaging)
    check_group_choices(verb, overrides)
    module = paths.recipe_module(VERBS[verb])
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise SystemExit(f"specheads: the recipe for '{verb}' ({VERBS[verb]}) is not in this version")
    sys.argv = [spec.origin, *overrides]
    # as `python -m specheads.recipes.<recipe>`: __name__ == "__main__", Hydra resolves
    # config_path="../conf" against the recipe's file, wherever the package is installed
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
