"""Every `specheads ...` command the README, the guides (docs/*.md) and the configs' comments (conf/**/*.yaml)
print parses as a shell would split it and composes against the recipe's real config (for `specheads run`:
the pipeline's config, then each stage's config with the overrides the pipeline hands it), so an example a
user copies cannot fail at Hydra's parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from specheads.cli import VERBS
from tests.test_hydra_configs import CONF, PRIMARY, compose_cfg, load_recipe

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(CONF.rglob("*.yaml"))]
COMMAND = re.compile(r"(?:^|&&|`|\s)(?:\.venv/bin/)?(specheads|python3? recipes/\w+\.py|python3? -m specheads\.recipes\.\w+)"
                     r"(\s[^`]*)?(?:`|$)")
RECIPE = {Path(recipe).stem: verb for verb, recipe in VERBS.items()}


def command_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) for each `specheads <verb> ...` (or `python recipes/<recipe>.py ...`) in a
    markdown file's code blocks and code spans, or a YAML file's comments; a trailing backslash continues."""
    lines, found, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        number, line = i + 1, lines[i]
        if path.suffix == ".yaml":
            line = line.partition("#")[2] if line.lstrip().startswith("#") else ""
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].lstrip("# ")
        for match in COMMAND.finditer(line):
            found.append((number, (match.group(1) + (match.group(2) or "")).strip()))
        i += 1
    return found


def verb_and_overrides(command: str) -> tuple[str, list[str]] | None:
    """The verb and the overrides a shell hands it; None for prose (`specheads trains ...`) or a placeholder."""
    words = shlex.split(command, comments=True)
    if words[0] == "specheads":
        if len(words) < 2 or words[1] not in VERBS:
            return None
        verb, args = words[1], words[2:]
    else:  # python recipes/<recipe>.py ... or python -m specheads.recipes.<recipe> ...
        stem = Path(words[1]).stem if words[1] != "-m" else words[2].rpartition(".")[2]
        verb, args = RECIPE.get(stem), words[2 if words[1] != "-m" else 3:]
        if verb is None:
            return None
    overrides = []
    for arg in args:
        if arg in ("...", "|", ">", "&&") or arg.startswith(("-", "[", "<", "(")) or "<" in arg or "{" in arg.partition("=")[0]:
            break  # a placeholder, a flag, an optional part in brackets or the rest of a pipe: what follows is prose
        overrides.append(arg)
    return verb, overrides


def examples() -> list:
    seen, params = set(), []
    for path in SOURCES:
        for number, command in command_lines(path):
            parsed = verb_and_overrides(command)
            if parsed is None or (parsed[0], tuple(parsed[1])) in seen:
                continue
            seen.add((parsed[0], tuple(parsed[1])))
            params.append(pytest.param(*parsed, id=f"{path.relative_to(ROOT)}:{number}"))
    return params


@pytest.fixture(scope="module")
def pipeline():
    for recipe in PRIMARY:
        load_recipe(recipe)
    return load_recipe("pipeline.py")


def check_composes(verb: str, overrides: list[str], pipeline) -> None:
    config = Path(VERBS[verb]).stem
    if verb == "run":
        overrides = pipeline.stage_arguments(overrides)
    OverridesParser.create().parse_overrides(overrides)
    if not (CONF / f"{config}.yaml").is_file():
        return  # a verb without a primary config of its own: its overrides parse
    cfg = compose_cfg(config, overrides)
    if verb == "run":
        for stage, recipe, stage_overrides in pipeline.stage_commands(cfg):
            compose_cfg(Path(recipe).stem, stage_overrides)


def test_the_docs_hold_the_commands_users_copy():
    commands = {(p.values[0], tuple(p.values[1])) for p in examples()}
    assert ("run", ("prepare.data=jsonl", "prepare.data.path=chats.jsonl")) in commands  # README
    assert len(commands) > 40


@pytest.mark.parametrize("verb,overrides", examples())
def test_every_documented_command_parses_and_composes(verb, overrides, pipeline):
    check_composes(verb, overrides, pipeline)


@pytest.mark.parametrize("line", [
    "specheads run prepare.data=jsonl prepare.data.path=chats.jsonl",
    "specheads run train.train.max_steps=20000 train.optim.lr=1e-3 head=medusa1",
    "specheads run 'evaluate.baselines=[ngram]' evaluate.eval.chat=4 'collect.method.aux_layers=[1,15,28]'",
    "specheads run 'export.training_data=\"ShareGPT, 600 chats\"' export.dtype=bfloat16",
    """specheads run 'stages.prepare=["data=jsonl","data.path=chats.jsonl"]'""",
    "specheads run 'stages.evaluate=[]' only=evaluate",
])
def test_the_one_line_forms_users_type(line, pipeline):
    verb, overrides = verb_and_overrides(line)
    check_composes(verb, overrides, pipeline)


def test_a_stage_override_reaches_its_stage_last_and_as_typed(pipeline, tmp_path):
    args = pipeline.stage_arguments(shlex.split(
        "prepare.data=jsonl prepare.data.path=chats.jsonl train.train.max_steps=7 "
        "'export.training_data=\"ShareGPT, 600 chats\"' 'train.wandb.name=${method.name}-x' run_dir=" + str(tmp_path)))
    stages = {name: overrides for name, _, overrides in pipeline.stage_commands(compose_cfg("pipeline", args))}
    assert stages["prepare"][-2:] == ["data=jsonl", "data.path=chats.jsonl"]
    assert stages["train"][-2:] == ["train.max_steps=7", "wandb.name=${method.name}-x"]  # the stage resolves it
    assert stages["export"][-1] == 'training_data="ShareGPT, 600 chats"'
    assert compose_cfg("train", stages["train"]).train.max_steps == 7


def test_the_unquoted_list_form_is_one_line_naming_the_form_that_works(pipeline, capsys):
    with pytest.raises(SystemExit) as e:
        pipeline.stage_arguments(["stages.prepare=[data=jsonl,data.path=chats.jsonl]"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "prepare.<key>=<value>" in err
