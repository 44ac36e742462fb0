"""A setting's value in its range, checked before any work: one ``ConfigError`` naming the setting as the user writes
it (``temperatures``, ``collect.batch_tokens``, ``vllm.max_model_len``...) and the values it takes. Every stage's
checks use these (training's in ``training/config.py``, evaluation's in ``evaluation/settings.py``, collection's,
serve-eval's)."""

from __future__ import annotations

import math
from typing import Any, Iterable

from specheads.errors import ConfigError

_RULES = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, ">= 2": lambda v: v >= 2,
          "in [0, 1]": lambda v: 0 <= v <= 1, "in [0, 1)": lambda v: 0 <= v < 1}


def check_number(setting: str, value: Any, rule: str, integer: bool = False, note: str = "") -> None:
    """Refuse ``value`` unless it is a finite number (an integer with ``integer``) obeying ``rule`` (a key of
    ``_RULES``; a leading "?" lets null through); ``note`` says what the setting means in the message."""
    if not (value is None and rule.startswith("?")) and not _obeys(value, rule.lstrip("?"), integer):
        raise ConfigError(f"{setting}={value} is out of range: {_allowed(rule, integer, note)}")


def check_numbers(setting: str, values: Iterable, rule: str, integer: bool = False, note: str = "",
                  allow_empty: bool = True) -> None:
    """``check_number`` on each item of a list setting, which must not repeat an item."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ConfigError(f"{setting}={values}: give a list, e.g. {setting}=[1]")
    values = list(values)
    shown = "[" + ", ".join(map(str, values)) + "]"
    if not values and not allow_empty:
        raise ConfigError(f"{setting}=[] is empty: {_allowed(rule, integer, note)}, at least one")
    for v in values:
        if not _obeys(v, rule, integer):
            raise ConfigError(f"{setting}={shown}: {v} is out of range: {_allowed(rule, integer, note)}")
    if len(set(values)) < len(values):
        raise ConfigError(f"{setting}={shown} repeats a value: give each once")


def _obeys(value: Any, rule: str, integer: bool) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and (isinstance(value, int) or not integer) and _RULES[rule](value)


def _allowed(rule: str, integer: bool, note: str) -> str:
    """What a setting takes: ``give an integer >= 1 (or null); <note>``."""
    kind = "an integer" if integer else "a finite number"
    return (f"give {kind} {rule.lstrip('?')}" + (" (or null)" if rule.startswith("?") else "")
            + (f"; {note}" if note else ""))


def check_choice(setting: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{setting}={value}: use one of {', '.join(map(str, choices))}")
