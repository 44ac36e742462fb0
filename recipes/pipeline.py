"""Recipe: the whole job (prepare -> collect -> train -> evaluate -> export [-> serve]), each stage in its own
process; serve (the export decoded by vLLM, ``serve_eval.py``) runs when the engine's venv exists (``serve=auto``).

    specheads run [head=medusa1] [run_dir=runs/x] [train.train.max_steps=500] [prepare.data=jsonl ...]

``<stage>.<override>`` adds one override to one stage: ``prepare.data=jsonl`` runs prepare with ``data=jsonl``
(``stage_arguments`` turns these into the config's ``extra.<stage>`` lists before Hydra reads the command line).
"""

import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from specheads.families import family

log = logging.getLogger("specheads.run")
# Stages run as modules (`python -m specheads.recipes.<stage>`), found through the installed package
# (a clone's editable install or site-packages) and run in the current directory.
RECIPES_PACKAGE = "specheads.recipes"


def stage_commands(cfg: DictConfig, serve: bool = False) -> list[tuple[str, str, list[str]]]:
    """(stage, recipe file, overrides) in order; every path lives under run_dir. ``serve``: end with the serve
    stage (``serve_stage_wanted``), on the evaluation's prompts and settings (its ``eval.*`` overrides)."""
    run = Path(cfg.run_dir)
    # a preset's dicts (architecture, eagle3, train_preset) are keys the stages' default target lacks: ++ adds them
    target = [f"{'++' if v and isinstance(v, (dict, list)) else ''}target.{k}={hydra_value(v)}"
              for k, v in OmegaConf.to_container(cfg.target, resolve=True).items()]
    prepared, features = run / "prepared", run / "features"
    train_out, report = run / "train" / cfg.head, run / "eval" / cfg.head
    data = ([f"features_dir={features}"] if cfg.offline else [f"prepared_dir={prepared}"])
    eval_method = "medusa" if cfg.head.startswith("medusa") else cfg.head
    # the heads that fuse several target layers (DFlash, DSpark, P-EAGLE, Domino) take EAGLE-3's by default: one
    # feature store (and one collection) serves them all
    store_method = "eagle3" if family(cfg.head).target_states == "aux" else cfg.head
    stages = [
        ("prepare", "prepare_data.py", [f"output_dir={prepared}"]),
        ("collect", "collect_hidden_states.py",
         [f"prepared_dir={prepared}", f"output_dir={features}", f"method={store_method}"]),
        ("train", "train.py", [f"method={cfg.head}", f"output_dir={train_out}", f"prepared_dir={prepared}", *data]),
        ("evaluate", "evaluate.py", [f"head_method={eval_method}", f"head_dir={train_out}",
                                     f"eval.chat_dir={prepared}", f"output_dir={report}",
                                     f"head_ngram_table={features if cfg.offline else prepared}"]),
        ("export", "export.py", [f"head_dir={train_out / 'head'}", f"output_dir={run / 'export' / cfg.head}",
                                 f"eval_report={report / 'report.json'}", f"training_data={prepared}", "overwrite=true"]),
    ]
    if serve:
        stages.append(("serve", "serve_eval.py", [f"export_dir={run / 'export' / cfg.head / 'vllm'}",
                                                  f"eval_report={report / 'report.json'}",
                                                  f"output_dir={run / 'serve' / cfg.head}", f"eval.chat_dir={prepared}"]))
    if not cfg.offline:
        stages = [s for s in stages if s[0] != "collect"]
    extra = {name: list(cfg.stages.get(name, [])) for name, _, _ in stages}
    if serve:  # the same prompts as the evaluation: its eval.* settings (of its stage list and the command line)
        evaluated = list(cfg.stages.evaluate) + list(cfg.get("extra", {}).get("evaluate", []))
        extra["serve"] = [o for o in evaluated if o.lstrip("+").startswith("eval.")] + extra["serve"]
    extra["train"] += list(cfg.head_overrides.get(cfg.head, []))
    for name in extra:
        extra[name] += list(cfg.get("extra", {}).get(name, []))
    return [(name, recipe, target + args + extra[name]) for name, recipe, args in stages]


# --------------------------------------------------------------------------- the command line

STAGES = ("prepare", "collect", "train", "evaluate", "export", "serve")


def serve_stage_wanted(setting, head: str) -> bool:
    """Whether the run ends with the serve stage: ``serve=true`` always (no engine: the stage's one-line error),
    ``false`` never, ``auto`` when an engine is found (``scripts/setup_engine.sh`` made ``.venv-vllm``)."""
    if isinstance(setting, bool):
        return setting
    if str(setting) != "auto":
        raise SystemExit(f"specheads run: error: serve={setting}: use serve=auto (when vLLM's venv exists), "
                         "serve=true or serve=false")
    if "vllm" not in family(head).layouts:  # no vLLM folder is exported for it (specheads/families.py)
        log.info("vLLM has no %s drafter: the run ends without the serve stage", family(head).title)
        return False
    from specheads.serving.engine import EngineNotFoundError, find_engine

    try:
        engine = find_engine()
    except EngineNotFoundError:
        log.info("no vLLM engine here (bash scripts/setup_engine.sh makes one): the run ends without the serve stage")
        return False
    log.info("vLLM %s found (%s): the run ends by serving the %s export in it (serve=false skips it)",
             engine.version, engine.python, head)
    return True


def hydra_quoted(item: str) -> str:
    """``item`` as one double-quoted element of a Hydra list override that reads back exactly as typed:
    backslashes before a quote or at the end doubled, quotes escaped, ``${`` kept for the stage to resolve."""
    item = re.sub(r'(\\*)("|$)', lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""), item)
    return '"' + item.replace("${", "\\${") + '"'


def hydra_value(value, nested: bool = False) -> str:
    """``value`` as an override's value that Hydra reads back as it is: a preset's dicts and lists in Hydra's
    own syntax (``{model_type:"llama",num_hidden_layers:32}``), not Python's repr, which it cannot parse; a
    plain top-level scalar as it prints."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v, True)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v, True) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str) and (nested or not re.fullmatch(r"[\w./:@+-]*", value)):
        return hydra_quoted(value)
    return str(value)


def stage_arguments(argv: list[str]) -> list[str]:
    """The command line with each ``<stage>.<override>`` moved into one ``extra.<stage>=[...]`` override.

    ``["prepare.data=jsonl", "prepare.data.path=c.jsonl", "head=eagle1"]`` ->
    ``["head=eagle1", 'extra.prepare=["data=jsonl","data.path=c.jsonl"]']``. Raises ``SystemExit`` with one
    line (exit status 2) for a ``stages.<stage>=[...]`` whose items hold an unquoted ``=``: Hydra cannot parse it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    rest, per_stage = [], {}
    for arg in argv:
        stage, dot, override = arg.partition(".")
        if dot and stage in STAGES and override:
            per_stage.setdefault(stage, []).append(override)
            continue
        if arg.startswith("stages.") and "=" in arg:
            try:
                OverridesParser.create().parse_overrides([arg])
            except OverrideParseException:
                name = arg.partition("=")[0].removeprefix("stages.")
                print(f"specheads run: error: cannot parse {arg!r}: add overrides to a stage one at a time, "
                      f"{name}.<key>=<value> (specheads run prepare.data=jsonl prepare.data.path=chats.jsonl), "
                      """or quote each list item that holds '=' ('stages.prepare=["data=jsonl"]')""", file=sys.stderr)
                raise SystemExit(2) from None
        rest.append(arg)
    return rest + [f"extra.{stage}=[{','.join(map(hydra_quoted, items))}]" for stage, items in per_stage.items()]


# --------------------------------------------------------------------------- done-markers
# A stage is skipped only when its marker (<run_dir>/.done/<stage>[.<head>].json, one per output folder)
# holds the fingerprint it would run with now: its own overrides plus the markers of every earlier
# stage (what they wrote is what it reads). A stage that re-runs writes a new marker, so every later
# stage re-runs too. A stage whose folder holds output made with other settings or inputs is cleared
# first (training and collection would otherwise resume from it); an interrupted run with the same
# fingerprint resumes from its folder.

MARKER_FORMAT = "specheads.stage/2"
OUTPUT_KEYS = ("output_dir", "out_dir")  # the override naming a stage's output folder (out_dir: its former name)
KEEPS_OUTPUT = {"prepare"}  # redoes its folder itself when stale, and keeps its regeneration journal


def stage_output(overrides: list[str]) -> Path | None:
    """The stage's output folder: the last ``output_dir=`` / ``out_dir=`` override (Hydra's last wins)."""
    out = None
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and key.lstrip("+") in OUTPUT_KEYS:
            out = Path(value)
    return out


def marker_name(name: str, output: Path | None, run_dir: Path) -> str:
    """``train`` writing ``<run_dir>/train/eagle3`` -> ``train.eagle3``: one marker per output folder, so
    switching heads back and forth keeps each head's marker (and its trained folder)."""
    try:
        rel = output.resolve().relative_to(run_dir.resolve()).parts[1:] if output is not None else ()
    except ValueError:  # a folder outside run_dir
        rel = (hashlib.sha256(str(output).encode()).hexdigest()[:8],)
    return ".".join([name, *rel])


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def marker_identity(marker: dict | None) -> str | None:
    """What a later stage records of this stage's output: its fingerprint and the id of the run that
    wrote it (a re-run with the same settings still rewrote the folder)."""
    if not marker or "fingerprint" not in marker:
        return None
    return f"{marker['fingerprint']}@{marker.get('run')}"


def stage_fingerprint(name: str, overrides: list[str], inputs: dict[str, str | None]) -> str:
    """Everything a stage's output depends on: its name, its overrides, the markers of its inputs."""
    blob = json.dumps({"stage": name, "overrides": list(overrides), "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def decide(fingerprint: str, overrides: list[str], marker: dict | None, started: dict | None) -> str:
    """``skip`` (finished with this fingerprint), ``resume`` (run, keeping what its folder holds) or
    ``fresh`` (run after clearing its folder: it holds output made from other settings or inputs).

    ``marker``: the finished marker (or one written before fingerprints, which holds only
    ``overrides``); ``started``: the record a launch leaves until the stage finishes.
    """
    if marker and marker.get("fingerprint") == fingerprint:
        return "skip"
    if started and started.get("fingerprint") == fingerprint:
        return "resume"  # interrupted with these settings: collection and training resume
    if marker is None and started is None:
        return "resume"  # nothing recorded: a first run (or a folder this pipeline never wrote)
    if marker and "fingerprint" not in marker and marker.get("overrides") == overrides and started is None:
        return "resume"  # an older marker with the same settings: re-run, resuming from the folder
    return "fresh"


def clear_output(output: Path | None, run_dir: Path) -> None:
    """Delete a stale output folder, only ever inside run_dir."""
    if output is None or not output.exists():
        return
    try:
        output.resolve().relative_to(run_dir.resolve())
    except ValueError:
        log.warning("%s holds output made with other settings, but lies outside run_dir %s: left in place "
                    "(the stage may resume from it)", output, run_dir)
        return
    log.info("clearing %s: it was made with other settings or inputs", output)
    if output.is_dir():
        shutil.rmtree(output)
    else:
        output.unlink()


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def run_stages(stages: list[tuple[str, str, list[str]]], run_dir: Path, only: str | None = None,
               optional: tuple[str, ...] = ()) -> list[str]:
    """Run the stages in order, each unless its marker is current; returns the stages that ran. A stage in
    ``optional`` that fails is reported and left unmarked (the run goes on, a re-run tries it again)."""
    run_dir, done_dir = Path(run_dir), Path(run_dir) / ".done"
    inputs: dict[str, str | None] = {}
    ran = []
    for name, recipe, overrides in stages:
        output = stage_output(overrides)
        key = marker_name(name, output, run_dir)
        marker_file, started_file = done_dir / f"{key}.json", done_dir / f"{key}.started.json"
        fingerprint = stage_fingerprint(name, overrides, dict(inputs))
        if only in (None, name):
            marker, started = read_json(marker_file), read_json(started_file)
            action = decide(fingerprint, overrides, marker, started)
            if action == "skip":
                log.info("[%s] finished earlier with the same settings and inputs; skipping", name)
            else:
                if action == "fresh" and name not in KEEPS_OUTPUT:
                    clear_output(output, run_dir)
                write_json(started_file, {"format": MARKER_FORMAT, "fingerprint": fingerprint, "inputs": inputs})
                try:
                    seconds = run_stage(name, recipe, overrides)
                except SystemExit as failed:
                    if name not in optional:
                        raise
                    log.warning("%s; the run goes on without it (serve=false leaves it out)", failed)
                    continue
                write_json(marker_file, {"format": MARKER_FORMAT, "fingerprint": fingerprint, "overrides": overrides,
                                         "inputs": inputs, "run": uuid.uuid4().hex[:16],
                                         "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": seconds})
                started_file.unlink(missing_ok=True)
                ran.append(name)
        inputs[key] = marker_identity(read_json(marker_file))
    return ran


class StageFailed(SystemExit):
    """A stage's process failed (it said why): the run ends with exit status 2 where the stage's was 2 (a user
    error, for scripts that tell them apart), else 1."""

    def __init__(self, message: str, returncode: int):
        super().__init__(2 if returncode == 2 else 1)
        self.message = message

    def __str__(self) -> str:
        return self.message


def run_stage(name: str, recipe: str, overrides: list[str]) -> float:
    """Run one stage's recipe in its own process; returns its seconds (a failure ends the pipeline)."""
    log.info("[%s] %s %s", name, recipe, " ".join(overrides))
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", f"{RECIPES_PACKAGE}.{Path(recipe).stem}", *overrides])
    if res.returncode != 0:
        raise StageFailed(f"specheads run: stage '{name}' failed (exit {res.returncode}); fix the cause and re-run "
                          "the same command: finished stages are skipped, this one resumes", res.returncode)
    log.info("[%s] done in %.0f s", name, time.time() - t0)
    return round(time.time() - t0, 1)


# --------------------------------------------------------------------------- the end of a run


def end_summary(run_dir: str | Path, head: str, offline: bool, target_here: str | None = None) -> str:
    """What the run leaves behind and what to do next: the evaluation's per-domain table (report.md), where
    every output is, and the commands that serve the exported head from here (``specheads.export.serve``).

    target_here: the target's local folder when it is one (the commands serve it as is)."""
    from specheads.export.serve import exported_lines

    run = Path(run_dir)
    report, export = run / "eval" / head / "report.md", run / "export" / head
    L = [report.read_text().rstrip(), ""] if report.is_file() else []
    places = [("prepared data", run / "prepared"), ("feature store", run / "features" if offline else None),
              ("trained head", run / "train" / head / "head"),
              ("training summary", run / "train" / head / "train_summary.json"),
              ("evaluation report", report), ("export", export)]
    if (run / "serve" / head).is_dir():  # the serve stage ran (or tried)
        places.append(("engine report", run / "serve" / head / "serve_report.md"))
    L += [f"specheads run: {run} ({head})", ""]
    for label, path in places:
        if path is not None:
            L.append(f"  {label:<18} {path}" + ("" if path.exists() else "   (not written)"))
    if export.is_dir():
        L += [f"  {'model cards':<18} README.md in each export folder (portable serve lines, measured acceptance)",
              "", "Serve the exported head from here (draft settings: the evaluation's recommendation for GPU "
              "serving):", ""] + [f"  {line}" for line in exported_lines(export, target_here)]
    return "\n".join(L)


def local_target_folder(name_or_path: str) -> str | None:
    """The target as a local folder the engines can serve as is, or None (a hub id, or the embedded name)."""
    return name_or_path if Path(name_or_path).expanduser().is_dir() else None


@hydra.main(config_path="../conf", config_name="pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    t0 = time.time()
    setting = True if cfg.only == "serve" and cfg.serve == "auto" else cfg.serve  # only=serve: asked for
    serve = serve_stage_wanted(setting, cfg.head) if cfg.only in (None, "serve") else False
    run_stages(stage_commands(cfg, serve), Path(cfg.run_dir), cfg.only, optional=("serve",) if setting == "auto" else ())
    OmegaConf.save(cfg, Path(cfg.run_dir) / "pipeline.yaml")
    log.info("pipeline finished in %.1f min; run folder: %s", (time.time() - t0) / 60, cfg.run_dir)
    print(end_summary(cfg.run_dir, cfg.head, cfg.offline, local_target_folder(str(cfg.target.name_or_path))))
    from specheads.run_summary import SUMMARY_FILE, write_summary

    given = OmegaConf.to_container(cfg.get("extra", {}), resolve=True)  # the <stage>.<override>s of the command line
    _, lines = write_summary(cfg.run_dir, cfg.head, cfg.offline, given)  # stage times and what each chose here
    print("\n".join(["", *lines, f"  (recorded in {Path(cfg.run_dir) / SUMMARY_FILE})"]))


def check_stages(argv: list[str]) -> None:
    """Compose the run's settings and every stage's (serve's included), as each stage will, and check the ranges
    of those a stage's ``check_config`` knows, before the first stage starts: a refused override or a value out
    of range is one line now, not after the stages before it have run."""
    import importlib

    from specheads import paths
    from specheads.errors import ConfigError, UserError, check_output_folder, user_errors
    from specheads.methods import trains_the_target
    from specheads.overrides import compose

    if any(arg.startswith("-") for arg in argv):  # Hydra's own options (--cfg job, --help): left to Hydra
        return
    with user_errors("run"):
        cfg = compose("pipeline", argv, "run")
        heads = sorted(p.stem for p in (paths.conf_dir() / "method").glob("*.yaml"))
        if cfg.head not in heads:
            raise ConfigError(f"head={cfg.head}: no head named '{cfg.head}'; choose one of: {', '.join(heads)}")
        if cfg.only is not None and cfg.only not in STAGES:
            raise ConfigError(f"only={cfg.only}: give one stage of {', '.join(STAGES)}, or null for the whole run")
        if str(cfg.serve) not in ("auto", "True", "False"):
            raise ConfigError(f"serve={cfg.serve}: use serve=auto (when vLLM's venv exists), serve=true or serve=false")
        if not isinstance(cfg.offline, bool):
            raise ConfigError(f"offline={cfg.offline}: use offline=true (collect a feature store first) or "
                              "offline=false (train on online features)")
        if cfg.offline and trains_the_target(cfg.head):
            raise ConfigError(f"head={cfg.head} trains the target itself, so its features cannot be stored: "
                              f"run it with offline=false")
        check_output_folder(cfg.run_dir, "run_dir")
        for name, recipe, overrides in stage_commands(cfg, serve=True):
            stem = Path(recipe).stem
            recipe_module = importlib.import_module(f"{RECIPES_PACKAGE}.{stem}")  # registers its schemas
            try:
                settings = compose(stem, overrides, "serve-eval" if name == "serve" else name)
                if hasattr(recipe_module, "check_config"):  # the ranges of its settings (no file is read)
                    recipe_module.check_config(settings)
            except UserError as e:
                raise ConfigError(f"the {name} stage: {e}") from None
            if name == "export" and cfg.only in (None, "export"):  # an export the target's engine would refuse
                from specheads.export.export import planned_export_refusal

                target = OmegaConf.select(settings, "target.name_or_path")  # None where unset: its own error
                if target and (refused := planned_export_refusal(cfg.head, settings.engine, target)):
                    raise ConfigError(f"the export stage: {refused}")


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *stage_arguments(sys.argv[1:])]
    check_stages(sys.argv[1:])
    try:
        main()
    except StageFailed as failed:
        print(failed, file=sys.stderr)
        raise SystemExit(failed.code) from None
