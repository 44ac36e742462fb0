"""Chat rendering with an exact assistant-only loss mask.

The target tokenizer's own chat template renders the conversation once. Each assistant turn's
character span (its content plus the template's end-of-turn token) is found by rendering the
conversation up to that turn with a generation prompt, which must be a prefix of the full text;
tokens are then tagged through the fast tokenizer's offset mapping. A template that rewrites
earlier turns (so the prefix property fails) is refused rather than masked approximately.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from specheads.data.sources import Conversation
from specheads.errors import SpecheadsError


class TemplateError(SpecheadsError, ValueError):
    """The chat template cannot give an exact assistant mask for this conversation."""


@dataclass
class Rendered:
    """input_ids: token ids of the rendered chat; loss_mask: 1 on assistant tokens (content and
    end-of-turn token); truncated: the chat was longer than max_length and was cut."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def chat_template_sha(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]


def end_of_turn_token(tokenizer) -> str:
    """The token a template closes an assistant turn with (``<|im_end|>`` for ChatML)."""
    if tokenizer.eos_token is None:
        raise TemplateError("tokenizer has no eos token to close assistant turns with")
    return tokenizer.eos_token


def assistant_spans(conv: Conversation, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """Full chat text and the (start, end) character span of each assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer has no chat template; give a chat/instruct model's tokenizer")
    eot = end_of_turn_token(tokenizer)
    full = tokenizer.apply_chat_template(conv.messages, tokenize=False)
    spans = []
    for i, msg in enumerate(conv.messages):
        if msg["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(conv.messages[:i], tokenize=False, add_generation_prompt=True)
        if not full.startswith(head) or not full.startswith(msg["content"], len(head)):
            raise TemplateError(f"conversation {conv.id}: the chat template is not prefix-stable at turn {i}; "
                                "an exact assistant mask cannot be derived from it")
        end = len(head) + len(msg["content"])
        if full.startswith(eot, end):
            end += len(eot)
        spans.append((len(head), end))
    return full, spans


def render(conv: Conversation, tokenizer, max_length: int) -> Rendered:
    """Tokenize a conversation with the chat template and mark its assistant tokens.

    A token belongs to a turn when it starts inside that turn's span. Chats longer than
    ``max_length`` tokens are cut to ``max_length``.
    """
    full, spans = assistant_spans(conv, tokenizer)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    s = 0
    for t, (start, _end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s < len(spans) and spans[s][0] <= start < spans[s][1]:
            mask[t] = 1
    truncated = len(ids) > max_length
    return Rendered(ids[:max_length], mask[:max_length], truncated)


def turn_token_groups(rendered: Rendered) -> list[list[int]]:
    """Masked token ids grouped into contiguous runs (one run per assistant turn)."""
    groups, current = [], []
    for tok, m in zip(rendered.input_ids, rendered.loss_mask):
        if m:
            current.append(tok)
        elif current:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups
