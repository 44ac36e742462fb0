"""Where the shipped recipes and Hydra configs live, in a clone and in an installed copy alike.

``pyproject.toml`` ships ``recipes/`` as ``specheads.recipes`` and ``conf/`` as ``specheads.conf``;
both are located through the import system, never relative to this file, so an installed copy
(site-packages) and an editable install of a clone give the same answers. Runs never go here: every
output path in the configs is relative to the current directory.
"""

from __future__ import annotations

import importlib
from pathlib import Path

RECIPES_PACKAGE = "specheads.recipes"
CONF_PACKAGE = "specheads.conf"


def _package_dir(name: str) -> Path:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in (name, name.rpartition(".")[0]):
            raise
        raise RuntimeError(f"{name} is not importable: this specheads was installed before recipes/ and conf/ "
                           "shipped inside the package; re-install it (`pip install .`, or `pip install -e .` "
                           "in a clone, or `bash scripts/setup.sh`)") from e
    return Path(next(iter(module.__path__))).resolve()


def recipes_dir() -> Path:
    """The folder of the recipe scripts (``recipes/`` in a clone, ``specheads/recipes`` installed)."""
    return _package_dir(RECIPES_PACKAGE)


def conf_dir() -> Path:
    """The folder of the Hydra configs (``conf/`` in a clone, ``specheads/conf`` installed)."""
    return _package_dir(CONF_PACKAGE)


def recipe_module(recipe: str) -> str:
    """``train`` or ``train.py`` -> ``specheads.recipes.train`` (for ``python -m`` / ``accelerate launch -m``)."""
    return f"{RECIPES_PACKAGE}.{Path(recipe).stem}"
