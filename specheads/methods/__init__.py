"""Head families as training methods: ``Method`` objects, one file per family.

``build_method(name, **settings)`` builds the ``Method`` registered as ``name`` (``METHODS``, read from each
family's ``methods`` in ``specheads/families.py``).
"""

from __future__ import annotations

import importlib

from specheads.errors import ConfigError
from specheads.families import training_methods
from specheads.methods.base import FeatureSpec, Method, StepOutput, TrainingModule

METHODS: dict[str, str] = training_methods()  # {name: "module:Class"}, from the family registry


class MethodSettingsError(ConfigError, TypeError):
    """A method setting that does not exist (``TypeError`` for callers that caught the old error)."""


def trains_the_target(name: str) -> bool:
    """Whether the method registered as ``name`` trains the target itself (Medusa-2), so that it trains on online
    features only: a feature store would go stale (its class declares ``feature_spec.online_only``)."""
    module, cls = METHODS[name].split(":")
    spec = getattr(getattr(importlib.import_module(module), cls), "feature_spec", None)
    return isinstance(spec, FeatureSpec) and spec.online_only


def build_method(name: str, **kwargs) -> Method:
    """The ``Method`` registered as ``name`` (see ``METHODS``), constructed with ``kwargs``.

    The settings are the user's (``method.*``): an unknown method, an unknown setting or a value the
    method's constructor refuses raises a ``ConfigError`` (shown as a one-line user error).
    """
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known: {sorted(METHODS)}")
    module, cls = METHODS[name].split(":")
    try:
        factory = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"method {name!r} needs {METHODS[name]}, which cannot be imported: {e}") from e
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise MethodSettingsError(f"bad settings for method {name!r} ({cls}): {e}") from e
    except ValueError as e:  # the constructor validates its settings, nothing else
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e) if name in str(e) else f"method {name}: {e}") from e


__all__ = ["FeatureSpec", "Method", "StepOutput", "TrainingModule", "METHODS", "build_method"]
