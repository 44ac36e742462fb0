"""Chat rendering with an exact assistant-only loss mask, for any chat template.

A sample's loss covers exactly the tokens the target generates at serving time for an assistant turn.
At turn ``i`` the serving engine's prompt is the template's rendering of the earlier messages with the
generation prompt; the turn's *generated text* is what the template's rendering of the chat up to and
including turn ``i`` adds after that prompt, through the special token that closes the turn
(``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|return|>``, ``</s>``...). A sentinel placed
after the turn's content finds where that is. The final turn's reasoning block, or an empty one a
template adds (Qwen3 with ``enable_thinking=False``), is part of the generated text; what a template
drops from history is not.

Templates that keep every earlier turn as it was generated (prefix-stable: ChatML, Llama 3, Gemma,
Mistral) give one sample per chat, every turn masked in the template's rendering of the whole chat.
Templates that rewrite history (Qwen3 and DeepSeek-R1 drop earlier turns' reasoning, gpt-oss harmony
keeps only their final channel) give one sample per turn whose generated text history does not keep
verbatim: its prompt plus its generated text; turns that history does keep share a later turn's
sample. ``ChatSamples`` says how many samples and turns that made.

Reasoning (a turn's ``reasoning_content``) is offered to the template under the field names templates
read (``reasoning_content``: Qwen3, ``thinking``: gpt-oss). A template that renders neither gets it
inline as ``<think>…</think>``; a template that cannot show the final turn after its own generation
prompt (DeepSeek-R1 distills strip reasoning even there) gets the turn written after the prompt as the
model writes it, counted in ``ChatSamples.written_turns``. A template that does not render a turn's
content at all is refused with the turn named.

Regenerated assistant turns carry the target's own ``token_ids``; they are placed as they are, never
decoded and re-tokenized (``render_exact``): the text around them is rendered by the template and
tokenized piece by piece, the same way for the regeneration prompt (``prompt_ids``) and for the final
chat, so the prompt's ids are a prefix of the sample's ids and the answer is exactly what the target
generated. A turn cut at the length cap (``truncated``) ends its sample without the turn closer.

Tool turns (role ``tool``: function-calling results) are kept when the template renders them; a
template that refuses them or drops their content raises ``ToolTurnError`` (the chat is skipped and
counted).

Image chats (``specheads.data.images``) render here with each image as its content part, which the template
shows as its placeholder token; ``render_image_samples`` puts each image's tokens in place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from specheads.data.images import (IMAGES, ImageSample, VisionRenderer, conversation_images, expand_images, open_image,
                                   template_content)
from specheads.data.sources import REASONING, Conversation
from specheads.errors import UserError

TOOL = "tool"
_SENTINEL = "\ue000{}\ue001"  # private-use characters marking where an assistant turn's content or tokens go
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TURN_SUFFIX = "@turn"  # a per-turn sample's id: "<chat id>@turn<message index>"
_REASONING_FIELDS = (REASONING, "thinking")  # the names templates read a turn's reasoning from
_INTERNAL = ("token_ids", "truncated", IMAGES)


class TemplateError(UserError, ValueError):
    """The chat template cannot give an exact assistant mask for this conversation."""


class ToolTurnError(TemplateError):
    """The chat template does not render tool turns (it refuses them or drops their content)."""


@dataclass
class Rendered:
    """input_ids: token ids of one sample; loss_mask: 1 on the generated tokens of its assistant turns;
    truncated: the sample was longer than max_length and was cut; turns: the message indices of the
    assistant turns its loss covers; suffix: "" for a chat's whole rendering, ``@turn<i>`` for a sample
    that ends at turn i."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    turns: tuple[int, ...] = ()
    suffix: str = ""


@dataclass
class ChatSamples:
    """The samples of one chat; written_turns: turns the template could not show after its own
    generation prompt, written there as the model writes them."""

    samples: list[Rendered]
    written_turns: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def split(self) -> bool:
        return len(self.samples) > 1 or any(s.suffix for s in self.samples)


def chat_id(sample_id: str) -> str:
    """The chat a sample id belongs to (per-turn samples of one chat share it)."""
    base, sep, turn = str(sample_id).rpartition(TURN_SUFFIX)
    return base if sep and turn.isdigit() else str(sample_id)


def chat_template_sha(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a turn written with its reasoning inline: ``<think>R</think>A`` (Qwen3,
    DeepSeek-R1, QwQ) or harmony channels (gpt-oss: ``…analysis<|message|>R<|end|>…final<|message|>A``);
    (None, text) when it has none."""
    if THINK_CLOSE in text:
        head, _, answer = text.partition(THINK_CLOSE)
        return head.split(THINK_OPEN, 1)[-1].strip("\n"), answer.lstrip("\n")
    final = "<|channel|>final<|message|>"
    if final in text:
        head, _, answer = text.rpartition(final)
        analysis = head.split("<|channel|>analysis<|message|>", 1)
        reasoning = analysis[1].split("<|end|>", 1)[0] if len(analysis) == 2 else None
        return reasoning, answer
    return None, text


def _special_strings(tokenizer) -> list[str]:
    """The tokenizer's special tokens, longest first (a turn closer is one of them)."""
    names = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            names.add(str(tok.content))
    return sorted((n for n in names if n), key=len, reverse=True)


class ChatRenderer:
    """A tokenizer's chat template with its keyword switches (``enable_thinking``...)."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template; give a chat/instruct model's tokenizer")
        self.tokenizer = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self.specials = _special_strings(tokenizer)
        vocab = tokenizer.get_vocab()
        self.think_tags = THINK_OPEN in vocab and THINK_CLOSE in vocab

    def text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``; a template that fails on a tool turn raises ToolTurnError."""
        from jinja2 import TemplateError as JinjaError

        msgs = [_template_view(m) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      **self.kwargs)
        except (JinjaError, TypeError, KeyError) as e:
            if any(m["role"] == TOOL for m in messages):
                raise ToolTurnError(f"the chat template refuses tool turns ({e})") from e
            raise TemplateError(f"the chat template fails on this chat ({type(e).__name__}: {e})") from e

    def tokens(self, piece: str) -> list[int]:
        return self.tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []

    def closer_at(self, text: str, start: int) -> int:
        """End of the first special token at or after ``start`` (the turn closer); ``start`` if none."""
        hits = [(p, p + len(s)) for s in self.specials if (p := text.find(s, start)) >= 0]
        return min(hits)[1] if hits else start

    def turn(self, messages: list[dict], i: int) -> tuple[str, str, bool]:
        """(prompt text, generated text, written) of assistant turn ``i``: the prompt the serving engine
        renders before it and what the target generates there. ``written``: the template cannot show the
        turn after its own prompt, so the turn was written after the prompt as the model writes it."""
        prompt = self.text(messages[:i], add_generation_prompt=True)
        msg = _plain(messages[i])
        reasoning, content = msg.get(REASONING), msg["content"]
        if reasoning is None:
            reasoning, content = split_reasoning(content)
            if reasoning is not None:
                msg = {**msg, "content": content, REASONING: reasoning}
        variants = [msg]
        if reasoning is not None:  # a template that ignores the reasoning fields may print it inline
            variants.append({k: v for k, v in msg.items() if k != REASONING} | {"content": _inline(reasoning, content)})
        closer_gap = None
        for v in variants:
            marked = self.text(messages[:i] + [{**v, "content": v["content"] + _SENTINEL.format(0)}])
            at = marked.find(_SENTINEL.format(0))
            if at < 0 or marked.count(_SENTINEL.format(0)) != 1:
                continue
            full = marked.replace(_SENTINEL.format(0), "")
            end = self.closer_at(full, at)
            closer_gap = full[at:end]
            generated = full[len(prompt):end]
            if full.startswith(prompt) and (not reasoning or reasoning.strip() in generated):
                return prompt, generated, False
        if closer_gap is None:
            raise TemplateError(f"turn {i}: the chat template does not render this assistant turn's content")
        written = _inline(reasoning, content) if (reasoning is not None or self._opens_think(prompt)) else content
        return prompt, _after_prompt(prompt, written) + closer_gap, True

    def _opens_think(self, prompt: str) -> bool:
        return self.think_tags and prompt.rstrip().endswith(THINK_OPEN)


def _template_view(m: dict) -> dict:
    """A message as templates read it: internal keys dropped, reasoning under every field name, images as
    content parts (``specheads.data.images``)."""
    out = _plain(m)
    if m.get(IMAGES):
        out["content"] = template_content(out["content"])
    if out.get(REASONING) is not None:
        out.update({k: out[REASONING] for k in _REASONING_FIELDS})
    return out


def _plain(m: dict) -> dict:
    return {k: v for k, v in m.items() if k not in _INTERNAL}


def _inline(reasoning: str | None, content: str) -> str:
    return f"{THINK_OPEN}\n{(reasoning or '').strip(chr(10))}\n{THINK_CLOSE}\n\n{content}"


def _after_prompt(prompt: str, written: str) -> str:
    """``written`` less the opening think tag a generation prompt already holds (DeepSeek-R1's ends in one)."""
    at = prompt.rfind(THINK_OPEN)
    if at >= 0 and not prompt[at:].strip(" \n").removeprefix(THINK_OPEN) and written.startswith(prompt[at:]):
        return written[len(prompt) - at:]
    return written


def check_tool_turns(messages: list[dict], text: str) -> None:
    """Every tool turn's content must appear in the rendered text (a template may silently drop them)."""
    for m in messages:
        if m["role"] == TOOL and m["content"] not in text:
            raise ToolTurnError("the chat template does not render tool turns (their content is missing from its text)")


def render_samples(conv: Conversation, tokenizer, max_length: int, template_kwargs: dict | None = None) -> ChatSamples:
    """The samples of a conversation: one when the template keeps history as generated, else one per
    turn that history rewrites (see the module docstring). Samples longer than ``max_length`` are cut.

    Token ids are the serving engine's: a turn's prompt tokenized whole, its generated text tokenized
    after it (a boundary where the two would merge, as Qwen3's ``</think>\n\n`` + answer, stays split).
    An earlier turn shares a later turn's sample only when its prompt and generated ids are a prefix of
    that sample's ids; turns whose prompt alone fills ``max_length`` end the chat.
    """
    renderer = tokenizer if isinstance(tokenizer, ChatRenderer) else ChatRenderer(tokenizer, template_kwargs)
    if any("token_ids" in m for m in conv.messages):
        return render_exact(conv.messages, renderer, max_length, conv_id=conv.id)
    msgs = conv.messages
    full = renderer.text(msgs)
    check_tool_turns(msgs, full)
    turns, written = {}, 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        try:
            prompt, generated, w = renderer.turn(msgs, i)
        except TemplateError as e:
            raise TemplateError(f"conversation {conv.id}: {e}") from e
        turns[i] = (renderer.tokens(prompt), renderer.tokens(generated), prompt + generated)
        written += w
        if len(turns[i][0]) >= max_length:  # later turns start past the length cap
            break
    samples, pending = [], sorted(turns)
    while pending:
        last = pending[-1]
        prompt, generated, text = turns[last]
        ids, suffix = prompt + generated, f"{TURN_SUFFIX}{last}"
        if last == max(turns) and full.startswith(text):  # the whole chat, as the template renders it
            ids, suffix = ids + renderer.tokens(full[len(text):]), ""
        mask = [0] * len(ids)
        covered = []
        for j in pending:
            p, g, _ = turns[j]
            if ids[:len(p) + len(g)] == p + g:
                covered.append(j)
                mask[len(p):len(p) + len(g)] = [1] * len(g)
        samples.append(Rendered(ids[:max_length], mask[:max_length], len(ids) > max_length, tuple(covered), suffix))
        pending = [j for j in pending if j not in covered]
    samples.reverse()
    if len(samples) == 1:
        samples[0].suffix = ""  # one sample covers the chat: it keeps the chat's id
    return ChatSamples(samples, written)


def render(conv: Conversation, tokenizer, max_length: int, template_kwargs: dict | None = None) -> Rendered:
    """The one sample of a chat whose template keeps its history as generated (``render_samples`` otherwise)."""
    out = render_samples(conv, tokenizer, max_length, template_kwargs)
    if len(out.samples) != 1:
        raise TemplateError(f"conversation {conv.id}: the chat template rewrites earlier turns; it gives "
                            f"{len(out.samples)} samples (use render_samples)")
    return out.samples[0]


def _marked(messages: list[dict]) -> tuple[list[dict], list[int]]:
    """Messages with each regenerated assistant turn's content replaced by a sentinel (reasoning dropped:
    the sentinel stands for all the turn's tokens), and those turns' indices."""
    marked, turns = [], []
    for m in messages:
        m = _plain(m)
        if m["role"] == "assistant":
            m = {k: v for k, v in m.items() if k != REASONING} | {"content": _SENTINEL.format(len(turns))}
            turns.append(len(marked))
        marked.append(m)
    return marked, turns


def _placed(messages: list[dict], renderer: ChatRenderer, add_generation_prompt: bool,
            conv_id: str) -> tuple[list[int], list[int], str]:
    """(ids, mask, text after the last turn) with every assistant turn's tokens placed verbatim in the
    template's text; TemplateError when the template does not keep them verbatim in that position."""
    tok = renderer.tokenizer
    marked, turns = _marked(messages)
    text = renderer.text(marked, add_generation_prompt)
    check_tool_turns(marked, text)
    answers = [list(messages[i].get("token_ids") or renderer.tokens(messages[i]["content"])) for i in turns]
    shown = text
    for t, ids in enumerate(answers):
        shown = shown.replace(_SENTINEL.format(t), tok.decode(ids))
    if shown != renderer.text(messages, add_generation_prompt):
        raise TemplateError(f"conversation {conv_id}: the chat template does not keep its assistant turns verbatim")
    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    for t, i in enumerate(turns):
        sentinel = _SENTINEL.format(t)
        head = renderer.text(marked[:i], add_generation_prompt=True)
        if text.find(sentinel) != len(head) or not text.startswith(head):
            raise TemplateError(f"conversation {conv_id}: the chat template is not prefix-stable at turn {i}")
        before = renderer.tokens(text[cursor:len(head)])
        ids += before + answers[t]
        mask += [0] * len(before) + [1] * len(answers[t])
        cursor = len(head) + len(sentinel)
        if messages[i].get("truncated"):  # cut at the length cap: never closed as if finished
            return ids, mask, ""
        end = renderer.closer_at(text, cursor)
        closer = renderer.tokens(text[cursor:end])
        ids += closer
        mask += [1] * len(closer)
        cursor = end
    return ids, mask, text[cursor:]


def prompt_ids(messages: list[dict], tokenizer, template_kwargs: dict | None = None, conv_id: str = "?") -> list[int]:
    """Token ids of the prompt for the assistant turn after ``messages``: earlier regenerated turns as
    their own ids where the template keeps them verbatim, else the template's text tokenized."""
    renderer = tokenizer if isinstance(tokenizer, ChatRenderer) else ChatRenderer(tokenizer, template_kwargs)
    try:
        ids, _, rest = _placed(messages, renderer, True, conv_id)
        return ids + renderer.tokens(rest)
    except ToolTurnError:
        raise
    except TemplateError:
        return renderer.tokens(renderer.text(messages, add_generation_prompt=True))


def render_exact(messages: list[dict], tokenizer, max_length: int = 1 << 62, conv_id: str = "?") -> ChatSamples:
    """The samples of a chat whose assistant turns are placed as token ids (``token_ids``, or the content
    tokenized on its own). One sample when the template keeps the turns verbatim; else one per turn:
    its prompt (``prompt_ids``) plus its ids and the template's turn closer."""
    renderer = tokenizer if isinstance(tokenizer, ChatRenderer) else ChatRenderer(tokenizer)
    try:
        ids, mask, rest = _placed(messages, renderer, False, conv_id)
        ids, mask = ids + renderer.tokens(rest), mask + [0] * len(renderer.tokens(rest))
        turns = tuple(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return ChatSamples([Rendered(ids[:max_length], mask[:max_length], len(ids) > max_length, turns)])
    except ToolTurnError:
        raise
    except TemplateError:
        pass
    samples = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = prompt_ids(messages[:i], renderer, conv_id=conv_id)
        answer = list(m.get("token_ids") or renderer.tokens(m["content"]))
        if not m.get("truncated"):
            marked = renderer.text(messages[:i] + [{**_plain(m), "content": _SENTINEL.format(0)}])
            at = marked.find(_SENTINEL.format(0))
            if at < 0:
                raise TemplateError(f"conversation {conv_id}: turn {i}: the chat template does not render its content")
            answer += renderer.tokens(marked[at + len(_SENTINEL.format(0)):renderer.closer_at(marked, at)])
        ids, mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
        samples.append(Rendered(ids[:max_length], mask[:max_length], len(ids) > max_length, (i,), f"{TURN_SUFFIX}{i}"))
    return ChatSamples(samples)


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


def render_image_samples(conv, renderer, vision: VisionRenderer, max_length: int) -> list[ImageSample]:
    """The rows of an image chat (``render_samples`` with each image's tokens in place). ``ImageError``
    when an image cannot be read; ``TemplateError`` when the template does not render one placeholder per image."""
    refs = conversation_images(conv.messages)
    grids = vision.grids([open_image(r) for r in refs])
    rendered = render_samples(conv, renderer, 1 << 62)
    samples = []
    for r in rendered.samples:
        shown = r.input_ids.count(vision.image_token_id)
        if shown > len(refs) or (not r.suffix and shown != len(refs)):
            raise TemplateError(f"conversation {conv.id}: the chat template renders {shown} image placeholder(s) "
                                f"for {len(refs)} image(s)")
        ids, mask, kept, cut = expand_images(r.input_ids, r.loss_mask, grids, vision, max_length)
        samples.append(ImageSample(ids, mask, refs[:kept], grids[:kept], cut, r.suffix))
    return samples
