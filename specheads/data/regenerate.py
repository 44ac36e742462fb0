"""Answer regeneration: replace assistant turns with the target's own answers.

Drafters learn the target's distribution, so self-distilled data (the target's answers to the
dataset's prompts) matches what they must predict at serving time. Generation is batched across
conversations (left padding), turn by turn, and resumable: every finished conversation is appended
to a JSONL journal with fsync; a re-run reads the journal, drops a torn last line, and continues
with the conversations not yet in it.

Answers are the target's tokens exactly: each regenerated turn keeps the generated ``token_ids`` (the
end-of-turn token excluded; the chat template closes the turn with it), the prompt of a later turn
is built from those ids where the template keeps earlier turns verbatim (``render.prompt_ids``), and
the prepared row holds the same ids. A thinking target's reasoning stays in the ids as it generated it;
the message also holds it apart (``reasoning_content``) for templates that drop it from history. An
answer that reached ``max_new_tokens`` without the end-of-turn token is kept as the chat's last turn,
marked ``truncated``: it is never closed as if the target had finished it, and it is counted
(``regenerated_truncated`` in specheads_meta.json, and the log). Journal records carry a key of the
settings and target; records made with other ones (or by a version that kept only text) are redone.

A re-run answers each chat in the batch an uninterrupted run would: batches are cut from every chat in one order
(the journal's chats included), each with its seed and cache salts from its place in that order, and a batch a
killed run left part-journaled (its records name their batch) is answered again whole, its journaled chats kept as
written. Answers, and with ``regenerate=engine`` the captured states, are then bitwise an uninterrupted run's
(the engine's kernels see the same batches). Chats whose batch was not begun by such a run (more chats asked for
than before) go together in batches after the planned ones; a serving endpoint answers only the chats missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm

from specheads.data.batch_generate import generate_static
from specheads.data.endpoint import EndpointClient, EndpointConfig
from specheads.data.engine_answers import EngineAnswers, EngineRegenConfig
from specheads.data.render import REASONING, ChatRenderer, TemplateError, prompt_ids, split_reasoning
from specheads.data.sources import Conversation
from specheads.errors import UserError
from specheads.targets import Target, eos_token_ids

log = logging.getLogger(__name__)


@dataclass
class RegenerateConfig:
    """max_new_tokens: length cap per answer; max_turns: assistant turns regenerated per chat (later
    turns are dropped); temperature 0 means greedy; max_prompt_tokens: longer prompts end the chat;
    loop: ``static`` (specheads.data.batch_generate: a preallocated cache, finished rows leave the batch;
    2.8x the tokens/s of ``hf`` for the bf16 SmolLM2 target on a CPU) or ``hf`` (Hugging Face ``generate``,
    for a model whose cache is not a transformers StaticCache)."""

    batch_size: int = 8
    max_new_tokens: int = 256
    max_turns: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    max_prompt_tokens: int = 1024
    seed: int = 0
    loop: str = "static"
    endpoint: EndpointConfig | dict | None = None  # a serving engine answers instead of the local target
    engine: EngineRegenConfig | dict | None = None  # vLLM answers here, capturing the states (data.engine_answers)

    def __post_init__(self):
        if self.loop not in ("static", "hf"):
            raise UserError(f"regenerate.loop must be 'static' or 'hf', got {self.loop!r}")
        if isinstance(self.endpoint, dict):
            self.endpoint = EndpointConfig(**self.endpoint)
        if isinstance(self.engine, dict):
            self.engine = EngineRegenConfig(**self.engine)
        if self.endpoint is not None and self.engine is not None:
            raise UserError("regenerate: set regenerate.endpoint (a server answers) or regenerate.engine (vLLM runs "
                            "here), not both")


class JournalError(UserError, ValueError):
    """The regeneration journal holds a line that is not a record (the message names the file and line)."""


def settings_key(target: Target, cfg: RegenerateConfig, template_kwargs: dict | None = None) -> str:
    """What a journaled answer depends on: the generation settings, the template's switches and the target
    (batch size aside)."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("batch_size", "loop", "endpoint", "engine")}
    if template_kwargs:
        settings["chat_template_kwargs"] = dict(template_kwargs)
    ident = {"settings": settings, "target": target.name, "tokenizer": target.tokenizer_fingerprint(),
             "config": target.config_hash() if target.model is not None else None, "format": 2}
    if cfg.endpoint is not None:  # the engine's answers: who served them, and how they were asked
        e = cfg.endpoint
        ident["endpoint"] = {"url": e.url, "model": e.model, "prompt_format": e.prompt_format, "extra_body": e.extra_body}
    if cfg.engine is not None:  # vLLM's answers, in its dtype
        from specheads.data.engine_features import engine_dtype

        ident["engine"] = {"engine": "vllm", "dtype": engine_dtype(cfg.engine.dtype)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def read_journal(path: Path, key: str | None = None,
                 batches: dict[str, str] | None = None) -> dict[str, Conversation]:
    """Finished conversations from a journal; a torn final line (crash mid-write) is cut off.

    ``key``: keep only records made with these settings (``settings_key``); others are redone. ``batches``: filled
    with each kept chat's batch (``batch_tag``), where its record names one.
    """
    done: dict[str, Conversation] = {}
    other = 0
    if not path.exists():
        return done
    raw = path.read_bytes()
    good_end = raw.rfind(b"\n") + 1
    if good_end < len(raw):
        log.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path, len(raw) - good_end)
        with path.open("r+b") as f:
            f.truncate(good_end)
    for lineno, line in enumerate(raw[:good_end].decode("utf-8").splitlines(), 1):
        try:
            rec = json.loads(line)
            if key is not None and rec.get("key") != key:
                other += 1
                continue
            done[rec["id"]] = Conversation(rec["id"], rec["messages"], rec.get("domain", "chat"))
            if batches is not None and rec.get("batch"):
                batches[rec["id"]] = str(rec["batch"])
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise JournalError(f"{path}:{lineno}: corrupt journal line ({e}); delete the file to start over") from e
    if other:
        log.info("%s: %d record(s) made with other regeneration settings, another target or an older version "
                 "are not reused", path, other)
    return done


def _append(f, conv: Conversation, key: str, batch: str | None = None) -> None:
    rec = {"id": conv.id, "messages": conv.messages, "domain": conv.domain, "key": key}
    if batch is not None:
        rec["batch"] = batch
    f.write(json.dumps(rec) + "\n")
    f.flush()
    os.fsync(f.fileno())


def batch_tag(offset: int, batch: list[Conversation]) -> str:
    """A batch's name in the journal: its place in the run's order and its chats, in order."""
    return hashlib.sha256("\n".join([str(offset)] + [c.id for c in batch]).encode()).hexdigest()[:16]


def plan_batches(convs: list[Conversation], done: dict[str, Conversation], batches: dict[str, str],
                 size: int, whole: bool = True) -> list[tuple[int, list[Conversation]]]:
    """(offset, chats) of the batches still to answer (module doc): chats of similar first-prompt length together
    (less left padding), cut from every chat; a batch with a journaled chat is answered whole when that chat's
    record names this batch (a killed run began it), else its missing chats join batches after the planned ones.
    ``whole=False`` (a server answers; batches do not change its answers): only the missing chats, as they come."""
    order = sorted(convs, key=_first_prompt_chars)
    if not whole:
        todo = [c for c in order if c.id not in done]
        return [(b, todo[b: b + size]) for b in range(0, len(todo), size)]
    planned, leftover = [], []
    for b in range(0, len(order), size):
        batch = order[b: b + size]
        missing = [c for c in batch if c.id not in done]
        if len(missing) == len(batch) or (missing and any(batches.get(c.id) == batch_tag(b, batch) for c in batch)):
            planned.append((b, batch))
        else:
            leftover += missing
    return planned + [(len(order) + b, leftover[b: b + size]) for b in range(0, len(leftover), size)]


@torch.no_grad()
def _generate(target: Target, prompts: list[list[int]], cfg: RegenerateConfig,
              generator_seed: int, stops: list[int]) -> list[tuple[list[int], bool]]:
    """(generated ids up to, not including, the end-of-turn token; finished) per prompt (token ids).

    ``stops``: the ids that end a turn (the eos token and the template's turn closer, e.g. Gemma's
    ``<end_of_turn>``). ``finished`` is False for an answer cut at ``max_new_tokens`` (no stop generated).
    """
    tok = target.tokenizer
    pad = tok.pad_token_id
    if cfg.loop == "static":
        return generate_static(target.model, prompts, cfg.max_new_tokens, stops, pad,
                               temperature=cfg.temperature, top_p=cfg.top_p, seed=generator_seed)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)
    sample = cfg.temperature > 0
    if sample:
        torch.manual_seed(generator_seed)
    out = target.model.generate(
        input_ids=input_ids, attention_mask=attention, max_new_tokens=cfg.max_new_tokens, do_sample=sample,
        temperature=cfg.temperature if sample else None, top_p=cfg.top_p if sample else None,
        top_k=None, pad_token_id=pad, eos_token_id=stops,
    )
    answers = []
    for row in out[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in stops]
        if ends:  # finished: what follows the end-of-turn token is padding
            answers.append((row[: ends[0]], True))
        else:  # generate ran every row to max_new_tokens: all of them are generated tokens
            answers.append((row[: cfg.max_new_tokens], False))
    return answers


def turn_stop_ids(renderer: ChatRenderer) -> list[int]:
    """The ids that end an assistant turn: the eos token and the special token the template closes a turn with."""
    tok = renderer.tokenizer
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text = renderer.text(probe)
    at = text.rfind("Hello") + len("Hello")
    closer = text[at:renderer.closer_at(text, at)]
    ids = {tok.eos_token_id} | {t for t in renderer.tokens(closer) if t in tok.all_special_ids}
    return sorted(i for i in ids if i is not None)


def _regenerate_batch(target: Target, batch: list[Conversation], cfg: RegenerateConfig, seed: int,
                      renderer: ChatRenderer, client: EndpointClient | None = None,
                      engine: EngineAnswers | None = None, salts: list[str] | None = None) -> list[Conversation]:
    """Regenerate up to cfg.max_turns assistant turns of each conversation, turn by turn.

    A chat keeps its messages up to its last regenerated answer; a prompt over ``max_prompt_tokens``,
    an empty answer or a cut one (kept, marked ``truncated``) ends it.
    """
    tok = target.tokenizer
    stops = sorted(set(turn_stop_ids(renderer)) | set(eos_token_ids(target)))  # the generation config's ids too
    work = [[dict(m) for m in c.messages] for c in batch]
    end = [0] * len(batch)  # each chat keeps work[j][:end[j]]
    stopped = [False] * len(batch)
    for turn in range(cfg.max_turns):
        todo, prompts = [], []
        for j, msgs in enumerate(work):
            idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            if stopped[j] or turn >= len(idx):
                continue
            # the prompt holds the earlier regenerated turns as their own token ids where the template keeps them
            try:
                prompt = prompt_ids(msgs[: idx[turn]], renderer, conv_id=batch[j].id)
            except TemplateError as e:
                log.warning("conversation %s: no prompt for turn %d (%s); the chat ends before it", batch[j].id, turn, e)
                stopped[j] = True
                continue
            if len(prompt) > cfg.max_prompt_tokens:
                stopped[j] = True
                continue
            todo.append((j, idx[turn]))
            prompts.append(prompt)
        if not todo:
            break
        flags = [{}] * len(prompts)
        if engine is not None:
            answers = engine.answer(prompts, [salts[j] for j, _ in todo], cfg.max_new_tokens, cfg.temperature,
                                    cfg.top_p, seed * 1000 + turn, stops)
        elif client is None:
            answers = _generate(target, prompts, cfg, seed * 1000 + turn, stops)
        else:
            got = client.complete_all(prompts, tok, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                                      seed * 1000 + turn, stops)
            answers = [(a.ids, a.finished) for a in got]
            flags = [{"retokenized": True} if a.retokenized else {} for a in got]
            flags = [{**f, "retokenize_mismatch": True} if a.mismatch else f for f, a in zip(flags, got)]
        for (j, i), (ids, finished), flag in zip(todo, answers, flags):
            text = tok.decode(ids)
            if not text.strip():
                stopped[j] = True  # an empty answer ends the chat before this turn
                continue
            reasoning, answer = split_reasoning(text)  # the target's reasoning kept apart, as templates take it
            work[j][i] = {"role": "assistant", "content": answer, "token_ids": ids, **flag}
            if reasoning is not None:
                work[j][i][REASONING] = reasoning
            end[j] = i + 1
            if not finished:  # cut at max_new_tokens: the chat ends with this open turn, never closed
                work[j][i]["truncated"] = True
                stopped[j] = True
    return [Conversation(c.id, msgs[: end[j]], c.domain) for j, (c, msgs) in enumerate(zip(batch, work))]


def regenerate(target: Target, conversations: Iterable[Conversation], journal: str | Path,
               cfg: RegenerateConfig, total: int | None = None, template_kwargs: dict | None = None,
               capture: Path | None = None, rows_of=None) -> list[Conversation]:
    """Regenerate answers for every conversation, resuming from ``journal``.

    With ``cfg.engine`` vLLM answers; with its capture on, ``rows_of(conversation)`` gives the token ids of the rows
    the prepared data will hold for a chat, whose states go to the ``CaptureCache`` at ``capture`` before the chat
    is journaled (``specheads.data.engine_answers``).

    Returns the conversations in input order; ones whose regenerated chat holds no assistant
    answer (prompt too long, empty answer) are left out and counted in the log. A chat whose last
    answer was cut at ``max_new_tokens`` ends with that turn marked ``truncated`` (see
    ``count_truncated``).
    """
    if target.tokenizer is None:
        raise UserError("answer regeneration needs the target's tokenizer")
    if target.tokenizer.pad_token is None:
        target.tokenizer.pad_token = target.tokenizer.eos_token
    target.tokenizer.padding_side = "left"
    journal = Path(journal)
    journal.parent.mkdir(parents=True, exist_ok=True)
    renderer = ChatRenderer(target.tokenizer, template_kwargs)
    client = None
    if cfg.endpoint is not None:
        client = EndpointClient(cfg.endpoint)
        cfg.endpoint.model = client.connect()  # fails here, before any work, when the server is not there
        log.info("answers from %s (model %s), %d requests at a time", cfg.endpoint.url, client.model,
                 cfg.endpoint.concurrency)
    key = settings_key(target, cfg, template_kwargs)
    engine = cache = None
    if cfg.engine is not None:
        engine = EngineAnswers(target, cfg.engine, journal.parent)
        if cfg.engine.capture and capture is not None and rows_of is not None:
            from specheads.data.capture_cache import CaptureCache

            cache = CaptureCache.open_for_writing(capture, {
                "target": target.name, "tokenizer": target.tokenizer_fingerprint(), "config": target.config_hash(),
                **engine.identity(), "layers": engine.layers, "last": True, "argmax": True})
    try:
        return _regenerate_all(target, conversations, journal, cfg, key, renderer, client, engine, cache, rows_of)
    finally:
        if engine is not None:
            if engine.positions:
                log.info("captured the states of %d tokens while answering; %d of them (%.0f%%) from the answers' "
                         "own forward passes, the rest (rows' template closers, cache-block remainders) computed "
                         "after", engine.positions, engine.reused, 100 * engine.reused / engine.positions)
            engine.close()


def _regenerate_all(target, conversations, journal, cfg, key, renderer, client, engine, cache, rows_of):
    tags: dict[str, str] = {}
    done = read_journal(journal, key, tags)
    convs = list(conversations)
    todo = plan_batches(convs, done, tags, cfg.batch_size, whole=client is None)
    left = sum(1 for c in convs if c.id not in done)
    again = sum(1 for _, batch in todo for c in batch if c.id in done)
    if done:
        log.info("resuming regeneration: %d conversations already in %s, %d to go%s", len(done), journal, left,
                 f" ({again} journaled ones answered again with the rest of the batch a killed run began, "
                 "their journaled answers kept)" if again else "")
    log.info("regenerating the answers of %d conversations with the target, %d per batch, up to %d new tokens per "
             "turn (the bar counts conversations; a batch reports when all its turns are done)", left,
             cfg.batch_size, cfg.max_new_tokens)
    with journal.open("a", encoding="utf-8") as f, tqdm(total=len(convs), initial=len(convs) - left,
                                                        desc="regenerate", unit="chat") as bar:
        for b, batch in todo:
            tag = batch_tag(b, batch) if client is None else None
            salts = [f"{b}:{j}:{c.id}" for j, c in enumerate(batch)]  # one chat's requests share its cache blocks
            out = _regenerate_batch(target, batch, cfg, cfg.seed + b, renderer, client, engine, salts)
            if engine is not None and engine.capturing:
                rows, row_salts = [], []
                if cache is not None:
                    for conv, salt in zip(out, salts):
                        if any(m["role"] == "assistant" for m in conv.messages):
                            for ids in rows_of(conv):
                                rows.append(list(ids))
                                row_salts.append(salt)
                states = engine.capture(rows, row_salts, release=salts)
                if cache is not None:
                    cache.add(rows, states)  # before the journal: a journaled chat's rows are in the cache
            new = [conv for conv in out if conv.id not in done]  # a journaled chat keeps its record
            for conv in new:
                done[conv.id] = conv
                _append(f, conv, key, tag)
            bar.update(len(new))
    result = [done[c.id] for c in convs if any(m["role"] == "assistant" for m in done[c.id].messages)]
    if len(result) < len(convs):
        log.warning("regeneration left %d conversations without an answer (prompt too long or empty answer)",
                    len(convs) - len(result))
    cut = count_truncated(result)
    if cut:
        log.warning("%d of %d regenerated chats end with an answer cut at regenerate.max_new_tokens=%d; they are "
                    "kept as the target wrote them, without an end-of-turn token (raise max_new_tokens for "
                    "finished answers)", cut, len(result), cfg.max_new_tokens)
    return result


def _first_prompt_chars(conv: Conversation) -> int:
    n = 0
    for m in conv.messages:
        if m["role"] == "assistant":
            break
        n += len(m.get("content") or "")
    return n


def count_retokenized(conversations: Iterable[Conversation]) -> dict[str, int]:
    """Chats with an engine's answer re-tokenized from its text, and those whose re-tokenization differs
    (from the engine's ids, or from its text when decoded)."""
    convs = list(conversations)
    return {"retokenized": sum(1 for c in convs if any(m.get("retokenized") for m in c.messages)),
            "retokenize_mismatch": sum(1 for c in convs if any(m.get("retokenize_mismatch") for m in c.messages))}


def count_truncated(conversations: Iterable[Conversation]) -> int:
    """Chats whose last answer was cut at the length cap."""
    return sum(1 for c in conversations if any(m.get("truncated") for m in c.messages))
