"""Chat rendering with an exact assistant-only loss mask.

The target tokenizer's own chat template renders the conversation once. Each assistant turn's
character span (its content plus the template's end-of-turn token) is found by rendering the
conversation up to that turn with a generation prompt, which must be a prefix of the full text;
tokens are then tagged through the fast tokenizer's offset mapping. A template that rewrites
earlier turns (so the prefix property fails) is refused rather than masked approximately.

Regenerated assistant turns carry the target's own ``token_ids``; they are placed as they are, never
decoded and re-tokenized (``render_exact``): the text around them is rendered by the template and
tokenized piece by piece, the same way for the regeneration prompt and for the final chat, so the
prompt's ids are a prefix of the chat's ids and the answer is exactly what the target generated. A
turn cut at the length cap (``truncated``) ends the chat without the end-of-turn token.

Tool turns (role ``tool``: function-calling results) are kept when the template renders them; a
template that refuses them or drops their content raises ``ToolTurnError`` (the chat is skipped and
counted).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from specheads.data.sources import Conversation
from specheads.errors import UserError

TOOL = "tool"
_SENTINEL = "\ue000{}\ue001"  # private-use characters marking where an assistant turn's tokens go


class TemplateError(UserError, ValueError):
    """The chat template cannot give an exact assistant mask for this conversation."""


class ToolTurnError(TemplateError):
    """The chat template does not render tool turns (it refuses them or drops their content)."""


def apply_template(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template's text for ``messages``; a template that fails on a tool turn raises ToolTurnError."""
    from jinja2 import TemplateError as JinjaError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except (JinjaError, TypeError, KeyError) as e:
        if any(m["role"] == TOOL for m in messages):
            raise ToolTurnError(f"the chat template refuses tool turns ({e})") from e
        raise


def check_tool_turns(messages: list[dict], text: str) -> None:
    """Every tool turn's content must appear in the rendered text (a template may silently drop them)."""
    for m in messages:
        if m["role"] == TOOL and m["content"] not in text:
            raise ToolTurnError("the chat template does not render tool turns (their content is missing from its text)")


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
    full = apply_template(tokenizer, conv.messages)
    check_tool_turns(conv.messages, full)
    spans = []
    for i, msg in enumerate(conv.messages):
        if msg["role"] != "assistant":
            continue
        head = apply_template(tokenizer, conv.messages[:i], add_generation_prompt=True)
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
    ``max_length`` tokens are cut to ``max_length``. A chat with regenerated turns (``token_ids``) is
    rendered by ``render_exact``.
    """
    if any("token_ids" in m for m in conv.messages):
        ids, mask = render_exact(conv.messages, tokenizer, conv_id=conv.id)
        return Rendered(ids[:max_length], mask[:max_length], len(ids) > max_length)
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


def render_exact(messages: list[dict], tokenizer, add_generation_prompt: bool = False,
                 conv_id: str = "?") -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a chat whose assistant turns are placed as token ids.

    Each assistant turn contributes its ``token_ids`` (or, lacking them, its content tokenized on its
    own) plus the end-of-turn token the template closes it with; a ``truncated`` turn contributes its
    ids only and ends the chat. The template's text around the turns is tokenized piece by piece.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer has no chat template; give a chat/instruct model's tokenizer")
    eot = end_of_turn_token(tokenizer)
    eot_id = tokenizer.convert_tokens_to_ids(eot)
    marked, turns = [], []
    for m in messages:
        m = {k: v for k, v in m.items() if k not in ("token_ids", "truncated")}
        if m["role"] == "assistant":
            m["content"] = _SENTINEL.format(len(turns))
            turns.append(len(marked))
        marked.append(m)
    text = apply_template(tokenizer, marked, add_generation_prompt)
    check_tool_turns(marked, text)

    def tokens(piece: str) -> list[int]:
        return tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []

    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    for t, i in enumerate(turns):
        sentinel = _SENTINEL.format(t)
        head = apply_template(tokenizer, marked[:i], add_generation_prompt=True)
        if text.find(sentinel) != len(head) or not text.startswith(head):
            raise TemplateError(f"conversation {conv_id}: the chat template is not prefix-stable at turn {i}; "
                                "an exact assistant mask cannot be derived from it")
        before = tokens(text[cursor:len(head)])
        turn = messages[i]
        answer = list(turn.get("token_ids") or tokens(turn["content"]))
        ids += before + answer
        mask += [0] * len(before) + [1] * len(answer)
        cursor = len(head) + len(sentinel)
        if turn.get("truncated"):  # cut at the length cap: never closed as if finished
            return ids, mask
        if text.startswith(eot, cursor):
            ids.append(eot_id)
            mask.append(1)
            cursor += len(eot)
    rest = tokens(text[cursor:])
    return ids + rest, mask + [0] * len(rest)


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
