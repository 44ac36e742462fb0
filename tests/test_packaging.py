"""`pip install .` outside the clone gives a working package: the `specheads` CLI, the recipes as
`python -m specheads.recipes.<name>` from any directory, and the Hydra configs (conf/ and its groups)
shipped inside it.

The project is built into a wheel from a copy of its sources (never the clone's own build/ folder)
and installed into a fresh venv in a temporary directory. That venv has no pip and sees the project
venv's site-packages through a .pth file, for the dependencies only: a directory named in a .pth file
is put on sys.path but its own .pth files are not run, so the clone's editable install stays inactive.
Every command runs from another temporary directory with a clean environment, and checks that the
specheads it imported is the installed one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "specheads", "kernels", "recipes", "conf"]


def _run(cmd, cwd, env, timeout=120):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("packaging")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_INDEX="1", HYDRA_FULL_ERROR="1")

    src = root / "src"  # a copy, so no stale build/ or egg-info of the clone ends up in the wheel
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO / name, src / name)
    wheels = root / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, src],
         cwd=root, env=env, timeout=180)
    (wheel,) = wheels.glob("specheads-*.whl")

    prefix = root / "venv"
    venv.EnvBuilder(with_pip=False).create(prefix)
    python = prefix / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=root, env=env).stdout.strip())
    # the dependencies: every site-packages this interpreter sees (the project venv's, and the system's
    # where the venv was made with --system-site-packages, as scripts/setup.sh does beside a GPU torch)
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                          *(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))])
    (site / "zz_specheads_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    # pip (from the project venv, via the .pth) run by the new venv's python installs into the new
    # venv, console script shebang included; -I: never touch what the project venv has installed
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "-I", "--no-warn-script-location", wheel],
         cwd=root, env=env, timeout=180)
    shutil.rmtree(src)  # nothing of the sources is left but the installed copy
    work = root / "work"
    work.mkdir()
    return {"python": python, "bin": prefix / "bin", "site": site.resolve(), "work": work, "env": env}


def run_in(installed, *cmd, cwd=None, timeout=120):
    return _run(cmd, cwd=cwd or installed["work"], env=installed["env"], timeout=timeout)


def test_the_installed_copy_is_the_one_imported(installed):
    out = run_in(installed, installed["python"], "-c",
                 "import specheads, specheads.recipes, specheads.conf, specheads.kernels; "
                 "print(specheads.__file__); print(specheads.recipes.__file__); print(specheads.conf.__file__)")
    for line in out.stdout.split():
        path = Path(line).resolve()
        assert path.is_relative_to(installed["site"]), f"{path} is not from the installed copy"
        assert not path.is_relative_to(REPO)


def test_every_module_and_config_ships(installed):
    package = installed["site"] / "specheads"
    for src, dst in (("specheads", package), ("recipes", package / "recipes"), ("kernels", package / "kernels")):
        want = {p.relative_to(REPO / src).as_posix() for p in (REPO / src).rglob("*.py")
                if (p.parent / "__init__.py").exists()}  # a package pyproject.toml forgot is missing here
        have = {p.relative_to(dst).as_posix() for p in dst.rglob("*.py")}
        assert want <= have, f"{src}/: not installed: {sorted(want - have)}"
    shipped = package / "conf"
    want = sorted(p.relative_to(REPO / "conf").as_posix() for p in (REPO / "conf").rglob("*.yaml"))
    have = sorted(p.relative_to(shipped).as_posix() for p in shipped.rglob("*.yaml"))
    assert have == want
    assert {"method/eagle3.yaml", "launcher/deepspeed_zero2.yaml", "data/sharegpt.yaml"} <= set(have)
    recipes = {p.name for p in (installed["site"] / "specheads" / "recipes").glob("*.py")}
    assert recipes >= {p.name for p in (REPO / "recipes").glob("*.py")}


def test_the_clones_kernels_folder_hides_no_installed_kernels_package():
    """`python -m`/`-c` run in the clone put its root first on sys.path. transformers imports Hugging Face's
    `kernels` package (a dependency of recent releases): the clone's kernels/ folder must give way to it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    code = ("import kernels, transformers.activations; import specheads.kernels as t; "
            "print(getattr(kernels, '__file__', None)); print(t.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    top, ours = proc.stdout.split()
    assert top == "None" or not Path(top).resolve().is_relative_to(REPO / "kernels"), f"`import kernels` gave {top}"
    assert Path(ours).resolve() == REPO / "kernels" / "__init__.py"


def test_configs_load_as_package_resources(installed):
    code = ("from hydra import compose, initialize_config_module\n"
            "with initialize_config_module('specheads.conf', version_base='1.3'):\n"
            "    cfg = compose('prepare_data', overrides=['data=jsonl', 'data.path=x', 'regenerate=greedy'])\n"
            "print(cfg.data.source, cfg.regenerate is not None, cfg.output_dir)")
    assert run_in(installed, installed["python"], "-c", code).stdout.split() == ["jsonl", "True", "runs/default/prepared"]


def test_cli_help_and_conf_dir(installed):
    cli = installed["bin"] / "specheads"
    assert cli.exists()
    assert cli.read_text().startswith(f"#!{installed['python']}")
    out = run_in(installed, cli, "--help").stdout
    assert "specheads train" in out and "verbs: prepare, collect, train, evaluate, export, run" in out
    conf = Path(run_in(installed, cli, "--conf-dir").stdout.strip())
    assert conf == installed["site"] / "specheads" / "conf"
    assert (conf / "launcher" / "deepspeed_zero2.yaml").exists()


def test_train_recipe_as_a_module_composes_the_shipped_groups(installed):
    # --help prints the config groups found in the shipped conf/ and the config composed with the overrides
    out = run_in(installed, installed["python"], "-m", "specheads.recipes.train", "--help",
                 "method=eagle3", "optim=adamw_lowlr").stdout
    groups = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line and not line.startswith(" "))
    assert {"eagle1", "eagle3", "medusa1", "medusa2"} <= set(groups["method"].split(", "))
    assert {"deepspeed_zero2", "deepspeed_zero3"} <= set(groups["launcher"].split(", "))
    assert {"smollm2", "hf"} <= set(groups["target"].split(", "))
    assert "  name: eagle3" in out and "output_dir: runs/default/train/" in out  # relative: the cwd
    assert not list(installed["work"].iterdir()), "printing a config must not write anything"


def test_cli_verbs_and_modules_run_the_installed_recipes(installed):
    # collect imports the train recipe's schemas: through the package, not a script folder on sys.path
    out = run_in(installed, installed["python"], "-m", "specheads.recipes.collect_hidden_states",
                 "--cfg", "job", "--resolve", "method=medusa1").stdout
    assert "  name: medusa1" in out and "output_dir: runs/default/features/medusa1" in out
    out = run_in(installed, installed["bin"] / "specheads", "run", "--cfg", "job", "head=eagle1").stdout
    assert "head: eagle1" in out and "run_dir: runs/quickstart" in out


@pytest.mark.slow
def test_pipeline_runs_a_stage_from_the_installed_copy_into_the_cwd(installed):
    """`specheads run` starts each stage as `python -m specheads.recipes.<stage>` (no script path of a
    clone); its outputs land under the current directory, never in site-packages. ~15 s: the
    prepare stage on 3 ShareGPT chats with the SmolLM2 tokenizer."""
    cwd = installed["work"].parent / "pipeline_cwd"
    cwd.mkdir()
    out = run_in(installed, installed["bin"] / "specheads", "run", "only=prepare", "run_dir=runs/t",
                 'stages.prepare=["data.num_samples=3","data.max_length=128"]', cwd=cwd, timeout=300)
    assert "[prepare] done" in out.stdout + out.stderr
    assert (cwd / "runs" / "t" / "prepared" / "specheads_meta.json").exists()
    assert (cwd / "runs" / "t" / ".done" / "prepare.json").exists()
    assert not [p for p in installed["site"].joinpath("specheads").rglob("*") if p.name in ("runs", "outputs")]


def _module_imports(package_dir):
    """{module: the specheads modules its module-level code imports by name} for the .py files under
    ``package_dir`` (imports inside functions and under ``if TYPE_CHECKING`` run later or never: not counted)."""
    import ast
    from pathlib import Path

    package_dir = Path(package_dir)
    names = {}
    for f in package_dir.rglob("*.py"):
        parts = f.relative_to(package_dir.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in names.items():
        deps = set()
        for node in ast.parse(f.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for sub in ast.walk(node) if isinstance(node, (ast.Try, ast.If)) else [node]:
                if isinstance(sub, ast.Import):
                    deps.update(a.name for a in sub.names)
                elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                    deps.add(sub.module)
                    deps.update(f"{sub.module}.{a.name}" for a in sub.names)
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def _cycles(graph):
    """The import circles of ``graph``: each strongly connected set of more than one module, sorted."""
    order, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        order[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return out


def test_no_module_imports_itself_back_through_another(tmp_path):
    from pathlib import Path

    assert _cycles(_module_imports(Path(__file__).resolve().parents[1] / "specheads")) == []
    pkg = tmp_path / "pkg"  # the check finds a circle through a package's __init__
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import x\n")
    (pkg / "a.py").write_text("import os\nfrom pkg import b\nx = 1\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    assert _cycles(_module_imports(pkg)) == [["pkg", "pkg.a"]]
