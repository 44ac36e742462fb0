"""Head families as training methods: ``Method`` objects, one file per family, and their registry.

``build_method(name, **settings)`` builds the ``Method`` registered as ``name`` (``METHODS``).
"""

from __future__ import annotations

import importlib

from specheads.methods.base import FeatureSpec, Method, StepOutput, TrainingModule

METHODS: dict[str, str] = {
    "medusa1": "specheads.methods.medusa:Medusa1Method",
    "medusa2": "specheads.methods.medusa:Medusa2Method",
    "eagle1": "specheads.methods.eagle1:Eagle1Method",
    "eagle3": "specheads.methods.eagle3:Eagle3Method",
}


def build_method(name: str, **kwargs) -> Method:
    """The ``Method`` registered as ``name`` (see ``METHODS``), constructed with ``kwargs``."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {sorted(METHODS)}")
    module, cls = METHODS[name].split(":")
    try:
        factory = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"method {name!r} needs {METHODS[name]}, which cannot be imported: {e}") from e
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise TypeError(f"bad settings for method {name!r} ({cls}): {e}") from e


__all__ = ["FeatureSpec", "Method", "StepOutput", "TrainingModule", "METHODS", "build_method"]
