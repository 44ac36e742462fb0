"""A target's tokenizer as its model ships it (``own_tokenizer``) and its fingerprint. Stages load it with
``target.chat_template`` applied: ``specheads.targets.loading.load_tokenizer``.
"""

from __future__ import annotations

import hashlib
import json

from specheads.targets.files import TARGET_HINT, TargetLoadError, resolve_target_path


def own_tokenizer(name_or_path: str):
    """The tokenizer of a target (embedded name, .gguf file, folder or hub id) with its own chat template, if any."""
    from transformers import AutoTokenizer

    path = resolve_target_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise TargetLoadError(f"cannot load the tokenizer of target '{name_or_path}': {e}; {TARGET_HINT}") from e


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of a tokenizer's vocabulary, special tokens and chat template."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()[:16]
