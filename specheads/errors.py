"""User errors: the input, settings or environment is at fault, not specheads.

Library code raises a ``UserError`` (or a subclass: ``SourceError``, ``TemplateError``,
``DataMismatchError``, ``CorruptShardError``, ``ExportError``, ...) where the user's input is wrong,
with a message naming the file or setting and what to do. Recipes wrap their body in
``user_errors()``: a ``UserError`` ends the run with one line on stderr and exit status 2; every
other exception is a bug (or an unforeseen failure) and keeps its full traceback. Set
``SPECHEADS_TRACEBACK=1`` to see the stack of a user error too.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """Base class of errors caused by the user's input, settings or environment, not by a bug."""


SpecheadsError = UserError
"""The earlier name of ``UserError`` (subclasses in the library still use it)."""


class ConfigError(UserError, ValueError):
    """A setting has a value that cannot work (the message names the setting and the accepted values)."""


class InputNotFoundError(UserError, FileNotFoundError):
    """A file or folder the stage reads does not exist (the message says which stage writes it)."""


def one_line(error: BaseException) -> str:
    """The error's message on one line (a multi-line message is joined with '; ')."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def missing_setting(error: BaseException) -> UserError | None:
    """A required setting left unset (``???`` in the recipe's config, read by the recipe) as a ``ConfigError``
    naming it; None for any other error."""
    from omegaconf.errors import MissingMandatoryValue

    if not isinstance(error, MissingMandatoryValue):
        return None
    key = getattr(error, "full_key", None) or "a setting"
    return ConfigError(f"{key} is required and has no default: give {key}=... on the command line")


def check_output_folder(path, setting: str = "output_dir") -> None:
    """Refuse, before any work, an output folder that cannot be one: the path (or a folder above it) is a file, or
    the nearest existing folder above it is not writable. The folder itself may exist or not."""
    p = Path(path).expanduser()
    for place in (p, *p.parents):
        if not place.exists():
            continue
        if not place.is_dir():
            what = "is a file" if place == p else f"is inside {place}, which is a file"
            raise ConfigError(f"{setting}={path} {what}: give a folder (a new one, or one this stage wrote)")
        if not os.access(place, os.W_OK | os.X_OK):
            raise ConfigError(f"{setting}={path}: {place} is not writable here: give a folder you can write to")
        return


def renamed_setting(stage: str, old: str, new: str, value):
    """``value`` of the setting ``old``, renamed ``new``: None when it was not given; when it was, one line on
    stderr (``specheads <stage>: warning: out_dir= is deprecated; use output_dir=``) and ``value`` (it wins)."""
    if value is not None:
        print(f"specheads {stage}: warning: {old}= is deprecated; use {new}= (it names the same folder)",
              file=sys.stderr)
    return value


@contextmanager
def user_errors(stage: str):
    """Show a ``UserError`` raised inside (or a required setting left unset: ``missing_setting``) as
    ``specheads <stage>: error: <message>`` and exit 2."""
    try:
        yield
    except Exception as e:
        error = e if isinstance(e, UserError) else missing_setting(e)
        if error is None or os.environ.get("SPECHEADS_TRACEBACK"):
            raise
        print(f"specheads {stage}: error: {one_line(error)}", file=sys.stderr)
        raise SystemExit(2) from None
