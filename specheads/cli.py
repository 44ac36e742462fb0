"""`specheads <verb> [hydra overrides...]`: each verb runs the recipe of the same stage.

    specheads prepare data.num_samples=200
    specheads collect method=eagle3
    specheads train method=eagle3
    specheads evaluate
    specheads export
    specheads run            # the whole pipeline on the embedded default (see recipes/pipeline.py)
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

VERBS = {
    "prepare": "prepare_data.py",
    "collect": "collect_hidden_states.py",
    "train": "train.py",
    "evaluate": "evaluate.py",
    "export": "export.py",
    "run": "pipeline.py",
}


def recipes_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "recipes"
    if not here.is_dir():
        raise SystemExit(f"specheads: recipes/ not found beside the package ({here}); "
                         "install specheads from a clone with `pip install -e .`")
    return here


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("verbs: " + ", ".join(VERBS))
        raise SystemExit(0 if argv else 2)
    verb, overrides = argv[0], argv[1:]
    if verb not in VERBS:
        raise SystemExit(f"specheads: unknown verb '{verb}'; choose one of: {', '.join(VERBS)}")
    recipe = recipes_dir() / VERBS[verb]
    if not recipe.exists():
        raise SystemExit(f"specheads: the recipe for '{verb}' ({recipe.name}) is not in this version")
    sys.argv = [str(recipe), *overrides]
    sys.path.insert(0, str(recipe.parent))
    runpy.run_path(str(recipe), run_name="__main__")


if __name__ == "__main__":
    main()
