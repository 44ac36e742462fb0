"""The family registry (``specheads/families.py``): every family is covered by every stage, and stages read the
registry instead of comparing family names.

Adding a family means one registry entry plus its own files; a stage that keeps its own list of families, or
branches on a family's name, is what this file catches. ``ALLOWED`` lists the files that still compare family
names outside a family's own files, with how many comparisons each holds: it only shrinks.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from specheads import families
from specheads.families import BASELINES, FAMILIES, NAMES, family, family_of_model_type

PACKAGE = Path(families.__file__).parent
RECIPES = PACKAGE.parent / "recipes"


def test_names_are_unique_and_aliases_resolve():
    assert len(set(NAMES)) == len(NAMES)
    assert not set(NAMES) & set(BASELINES)
    for f in FAMILIES:
        for alias in f.aliases:
            assert family(alias) is f
        assert family_of_model_type(f.model_type) is f
        assert f.target_states in ("last", "aux")
    assert family("medusa1").name == family("medusa2").name == "medusa"
    with pytest.raises(KeyError):
        family("ngram")


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.name)
def test_classes_import_and_agree(f):
    """The model and config classes exist and the config's ``model_type`` is the registry's; each training method's
    class, the drafter builder and the evaluator's row planner exist."""
    assert f.config_class().model_type == f.model_type
    assert issubclass(f.model_class().config_class, f.config_class())
    for ref in (*f.methods.values(), f.drafter, f.rows):
        assert callable(families.load(ref))
    for m, ref in f.methods.items():  # the registry's training facts agree with the method classes'
        cls = families.load(ref)
        assert getattr(cls, "trains_image_rows", False) == f.image_rows
        assert (m in f.online_methods) == bool(getattr(getattr(cls, "feature_spec", None), "online_only", False))
    if f.exported:  # a layout of ours: what its head folder holds and each engine's folder
        assert all(callable(families.load(ref)) for ref in (f.head_tensors, f.build_layout, f.card_facts,
                                                            f.foreign_config))


def test_every_stage_covers_every_family():
    from recipes.evaluate import HEAD_ALIASES
    from specheads.evaluation import suite
    from specheads.export import engine_targets, foreign, layouts, serve
    from specheads.methods import METHODS

    assert set(METHODS) == {m for f in FAMILIES for m in f.methods}
    assert suite.HEADS == NAMES and suite.DRAFTERS == (*BASELINES, *NAMES)
    assert suite.HEAD_MODEL_TYPES == {f.name: f.model_type for f in FAMILIES}
    assert set(HEAD_ALIASES) == {a for f in FAMILIES for a in f.aliases}
    assert set(layouts.METHODS) == {f.name for f in FAMILIES if f.layouts}
    for f in FAMILIES:
        assert layouts.engines_for(f.name) == tuple(e for e in layouts.ENGINES if e in f.layouts)
        assert set(f.layouts) <= set(layouts.ENGINES)
        assert (f.name in engine_targets.AUX_STATE_METHODS) == f.aux_states
        assert (f.speculators_type in foreign.SPECULATORS_METHODS) == (f.speculators_type is not None)
        if f.vllm_method:
            spec = serve.vllm_speculative_config(f.name, "m", 3)
            assert spec["method"] == f.vllm_method and f.vllm_extra.items() <= spec.items()
    assert "speculators" not in families.family("medusa").layouts  # speculators 0.9 has no Medusa model


def test_titles_are_the_registry_s():
    from specheads.export import card

    assert "_TITLES" not in vars(card)


# ------------------------------------------------------------------ no stage compares family names

FAMILY_WORDS = {*NAMES, *(a for f in FAMILIES for a in f.aliases)}
# files of one family: they may name it (and the families it builds on)
OWN = {"families.py", "methods/", "models/", "decoding/head_drafters.py", "decoding/peagle_drafter.py",
       "decoding/dspark_drafter.py", "decoding/mtp_drafter.py", "export/mtp.py"}
# the files that still compare family names outside their own family's files, and how many comparisons each holds:
# none now, so any comparison a stage adds fails
ALLOWED: dict[str, int] = {}


def _comparisons(tree: ast.AST) -> int:
    """Comparisons (``==``, ``!=``, ``in``, ``not in``) against a family name or a tuple of them."""
    def names_family(node) -> bool:
        if isinstance(node, ast.Constant) and node.value in FAMILY_WORDS:
            return True
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(names_family(e) for e in node.elts)

    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Compare)
               and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
               and any(names_family(n) for n in (node.left, *node.comparators)))


def _counts() -> dict[str, int]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if any(rel == o or (o.endswith("/") and rel.startswith(o)) for o in OWN):
            continue
        n = _comparisons(ast.parse(path.read_text()))
        if n:
            out[rel] = n
    return out


def test_family_name_comparisons_only_shrink():
    counts = _counts()
    grown = {rel: n for rel, n in counts.items() if n > ALLOWED.get(rel, 0)}
    assert not grown, (f"family-name comparisons outside a family's files: {grown} (allowed: "
                       f"{ {k: ALLOWED.get(k, 0) for k in grown} }); read the family registry (specheads/families.py) "
                       "instead, or add a field there")
    shrunk = {rel: (ALLOWED[rel], counts.get(rel, 0)) for rel in ALLOWED if counts.get(rel, 0) < ALLOWED[rel]}
    assert not shrunk, f"fewer comparisons than ALLOWED says (allowed, now): {shrunk}; lower ALLOWED"


def test_the_registry_imports_no_stage():
    imported = {n.module for n in ast.walk(ast.parse(inspect.getsource(families)))
                if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.startswith("specheads")}


def test_decoding_imports_no_export():
    """Drafters draft; reading a head folder (ours or another toolkit's) is ``specheads/heads.py``'s job."""
    for path in sorted((PACKAGE / "decoding").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("specheads.export"), f"{path.name} imports {node.module}"
