"""Answer regeneration: replace assistant turns with the target's own answers.

Drafters learn the target's distribution, so self-distilled data (the target's answers to the
dataset's prompts) matches what they must predict at serving time. Generation is batched across
conversations (left padding), turn by turn, and resumable: every finished conversation is appended
to a JSONL journal with fsync; a re-run reads the journal, drops a torn last line, and continues
with the conversations not yet in it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm

from specheads.data.sources import Conversation
from specheads.targets import Target

log = logging.getLogger(__name__)


@dataclass
class RegenerateConfig:
    """max_new_tokens: length cap per answer; max_turns: assistant turns regenerated per chat (later
    turns are dropped); temperature 0 means greedy; max_prompt_tokens: longer prompts end the chat."""

    batch_size: int = 8
    max_new_tokens: int = 256
    max_turns: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    max_prompt_tokens: int = 1024
    seed: int = 0


def read_journal(path: Path) -> dict[str, Conversation]:
    """Finished conversations from a journal; a torn final line (crash mid-write) is cut off."""
    done: dict[str, Conversation] = {}
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
            done[rec["id"]] = Conversation(rec["id"], rec["messages"], rec.get("domain", "chat"))
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{path}:{lineno}: corrupt journal line ({e}); delete the file to start over") from e
    return done


def _append(f, conv: Conversation) -> None:
    f.write(json.dumps({"id": conv.id, "messages": conv.messages, "domain": conv.domain}) + "\n")
    f.flush()
    os.fsync(f.fileno())


@torch.no_grad()
def _generate(target: Target, prompts: list[str], cfg: RegenerateConfig, generator_seed: int) -> list[str]:
    tok = target.tokenizer
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False,
              truncation=True, max_length=cfg.max_prompt_tokens).to(target.device)
    sample = cfg.temperature > 0
    if sample:
        torch.manual_seed(generator_seed)
    out = target.model.generate(
        **enc, max_new_tokens=cfg.max_new_tokens, do_sample=sample,
        temperature=cfg.temperature if sample else None, top_p=cfg.top_p if sample else None,
        top_k=None, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )
    new = out[:, enc["input_ids"].shape[1]:]
    return [tok.decode(row, skip_special_tokens=True).strip() for row in new]


def _regenerate_batch(target: Target, batch: list[Conversation], cfg: RegenerateConfig, seed: int) -> list[Conversation]:
    """Regenerate up to cfg.max_turns assistant turns of each conversation, turn by turn."""
    tok = target.tokenizer
    work = [[dict(m) for m in c.messages] for c in batch]
    cut = [None] * len(batch)  # where each chat ends after regeneration
    for turn in range(cfg.max_turns):
        todo, prompts = [], []
        for j, msgs in enumerate(work):
            idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            if turn >= len(idx) or cut[j] is not None and cut[j] <= idx[turn]:
                continue
            prompt = tok.apply_chat_template(msgs[: idx[turn]], tokenize=False, add_generation_prompt=True)
            if len(tok(prompt, add_special_tokens=False)["input_ids"]) > cfg.max_prompt_tokens:
                cut[j] = idx[turn]
                continue
            todo.append((j, idx[turn]))
            prompts.append(prompt)
        if not todo:
            break
        answers = _generate(target, prompts, cfg, seed * 1000 + turn)
        for (j, i), answer in zip(todo, answers):
            if answer:
                work[j][i]["content"] = answer
                cut[j] = i + 1
            else:
                cut[j] = i  # an empty answer ends the chat before this turn
    return [Conversation(c.id, msgs[: cut[j] or 0], c.domain) for j, (c, msgs) in enumerate(zip(batch, work))]


def regenerate(target: Target, conversations: Iterable[Conversation], journal: str | Path,
               cfg: RegenerateConfig, total: int | None = None) -> list[Conversation]:
    """Regenerate answers for every conversation, resuming from ``journal``.

    Returns the conversations in input order; ones whose regenerated chat holds no assistant
    answer (prompt too long, empty answer) are left out and counted in the log.
    """
    if target.tokenizer is None:
        raise ValueError("answer regeneration needs the target's tokenizer")
    if target.tokenizer.pad_token is None:
        target.tokenizer.pad_token = target.tokenizer.eos_token
    target.tokenizer.padding_side = "left"
    journal = Path(journal)
    journal.parent.mkdir(parents=True, exist_ok=True)
    done = read_journal(journal)
    convs = list(conversations)
    todo = [c for c in convs if c.id not in done]
    if done:
        log.info("resuming regeneration: %d conversations already in %s, %d to go", len(done), journal, len(todo))
    with journal.open("a", encoding="utf-8") as f, tqdm(total=len(convs), initial=len(convs) - len(todo),
                                                        desc="regenerate", unit="chat") as bar:
        for b in range(0, len(todo), cfg.batch_size):
            batch = todo[b: b + cfg.batch_size]
            for conv in _regenerate_batch(target, batch, cfg, cfg.seed + b):
                done[conv.id] = conv
                _append(f, conv)
            bar.update(len(batch))
    result = [done[c.id] for c in convs if any(m["role"] == "assistant" for m in done[c.id].messages)]
    if len(result) < len(convs):
        log.warning("regeneration left %d conversations without an answer (prompt too long or empty answer)",
                    len(convs) - len(result))
    return result
