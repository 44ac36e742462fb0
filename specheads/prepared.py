"""A prepared set's folder as later stages read it: its format marker, its metadata file and ``load_prepared``.

``specheads.data.prepare`` writes such folders; the draft vocabulary (``specheads.models.vocab``) and the data
stages read them, so the reader sits here, below both, and neither imports the other for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from specheads.errors import InputNotFoundError, UserError

FORMAT = "specheads.prepared/1"
META_FILE = "specheads_meta.json"


class DataMismatchError(UserError, ValueError):
    """Prepared data (or features) made for another tokenizer / target / setting."""


def load_prepared(path: str | Path):
    """(datasets.Dataset, meta dict) of a prepared folder; a folder of another kind is refused."""
    import datasets  # late: `datasets` (and pyarrow) take seconds to import, and most callers never read a folder

    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.exists():
        raise InputNotFoundError(f"{path} is not a prepared dataset (no {META_FILE}); run `specheads prepare` first")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise DataMismatchError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return datasets.load_from_disk(str(path)), meta
