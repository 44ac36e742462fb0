"""How many tokens one row may hold for a target: its context length, and the check that a stage's row length fits.

The limit is the model's own: ``max_position_embeddings`` of its config (the text config of a multimodal one), the
positions it was built and trained for. A tokenizer's ``model_max_length`` is read only where no config says it:
tokenizers often carry another number (Qwen3-8B's 131072 beside its config's 40960, the extended length its card
reaches with YaRN, which the config must then name) or transformers' placeholder for "unset" (about 1e30).
"""

from __future__ import annotations

from dataclasses import dataclass

from specheads.errors import ConfigError

UNSET_TOKENIZER_LENGTH = 10**9  # transformers writes VERY_LARGE_INTEGER (~1e30) when a tokenizer names no length


@dataclass(frozen=True)
class ContextLimit:
    """``tokens`` a row may hold, and ``source``: where that number comes from (for messages)."""

    tokens: int
    source: str


def context_limit(config=None, tokenizer=None) -> ContextLimit | None:
    """The target's context (module doc) from its transformers ``config`` and/or ``tokenizer``; None when neither
    names one."""
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n = getattr(text, "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return ContextLimit(n, f"max_position_embeddings {n} in its config")
    n = getattr(tokenizer, "model_max_length", None) if tokenizer is not None else None
    if isinstance(n, int) and 0 < n < UNSET_TOKENIZER_LENGTH:
        return ContextLimit(n, f"its tokenizer's model_max_length {n}")
    return None


def read_context_limit(name_or_path: str, tokenizer=None) -> ContextLimit | None:
    """``context_limit`` of a target known by name: its config.json read where it is on this machine (a folder, a
    converted embedded target, a hub id in the local cache), else the tokenizer's length, else None."""
    from specheads.targets.files import resolve_target_path

    config = None
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(resolve_target_path(name_or_path), local_files_only=True)
    except Exception:  # noqa: BLE001 - no config here: the tokenizer's length, or no check
        pass
    return context_limit(config, tokenizer)


def check_fits_context(setting: str, tokens: int, limit: ContextLimit | None, target: str) -> None:
    """Refuse a row length over the target's context (a ``ConfigError`` naming ``setting``): rows past it would be
    positions the model never saw, or would be cut where the user asked for them whole."""
    if limit is not None and int(tokens) > limit.tokens:
        raise ConfigError(f"{setting}={tokens} is longer than target '{target}' can read ({limit.tokens} tokens: "
                          f"{limit.source}); give at most {limit.tokens}")
