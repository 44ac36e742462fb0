"""User-facing errors: what was wrong and where, without a bare traceback.

Library code raises ``SpecheadsError`` subclasses (or ``FileNotFoundError`` / ``ValueError`` with a
message naming the file and the fix); recipes wrap their body in ``user_errors()`` so such an error
ends the run with one clear line and exit status 2. Set SPECHEADS_TRACEBACK=1 to see the stack.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager


class SpecheadsError(Exception):
    """Base class of errors caused by the user's input or environment, not by a bug."""


@contextmanager
def user_errors(stage: str):
    try:
        yield
    except (SpecheadsError, FileNotFoundError, ValueError, OSError) as e:
        if os.environ.get("SPECHEADS_TRACEBACK"):
            raise
        print(f"specheads {stage}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
