"""Answers from a serving engine: prompts sent to an OpenAI-compatible ``/v1/completions`` endpoint.

vLLM, SGLang, llama.cpp's server and ``transformers serve`` all answer ``POST <url>/completions``. The
prompt is the chat template's own rendering (``render.prompt_ids``), sent as text or, where the engine
takes them (vLLM, SGLang), as token ids, so the engine never re-applies a template. Many prompts are
in flight at once (``concurrency`` threads); a failed request is retried with back-off and then ends
the run with the endpoint's message (the journal keeps every chat finished before it).

The answer's token ids are the engine's where it returns them (vLLM with ``extra_body:
{return_token_ids: true}``: ``choices[0].token_ids``); otherwise the text is re-tokenized, and an answer
whose re-tokenization does not decode back to the same text is marked, so the prepared metadata can
count them. ``finish_reason == "length"`` marks an answer cut at ``max_tokens``.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from specheads.errors import UserError

log = logging.getLogger(__name__)


class EndpointError(UserError, RuntimeError):
    """The serving endpoint cannot be reached or refuses a request (the message names it and what it said)."""


@dataclass
class EndpointConfig:
    """url: the API base (``http://host:8000/v1``); model: the served name (null: the first of ``/models``);
    prompt_format: ``text`` (every engine) or ``token_ids`` (vLLM, SGLang); extra_body: engine-specific
    request fields (vLLM: ``{return_token_ids: true, skip_special_tokens: false}``)."""

    url: str
    model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 8
    timeout_s: float = 600.0
    retries: int = 3
    prompt_format: str = "text"
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not str(self.url).startswith(("http://", "https://")):
            raise UserError(f"regenerate.endpoint.url={self.url!r}: give the API base, e.g. http://127.0.0.1:8000/v1")
        if self.prompt_format not in ("text", "token_ids"):
            raise UserError(f"regenerate.endpoint.prompt_format must be 'text' or 'token_ids', got {self.prompt_format!r}")
        if self.concurrency < 1 or self.retries < 0 or self.timeout_s <= 0:
            raise UserError("regenerate.endpoint: concurrency >= 1, retries >= 0 and timeout_s > 0 are needed, got "
                            f"{self.concurrency}, {self.retries}, {self.timeout_s}")
        self.url = str(self.url).rstrip("/")


@dataclass
class Answer:
    ids: list[int]
    finished: bool
    retokenized: bool  # the engine returned text only: ids are the tokenizer's
    mismatch: bool  # re-tokenized ids that do not decode to the engine's text, or differ from the engine's ids


class EndpointClient:
    def __init__(self, cfg: EndpointConfig):
        self.cfg = cfg
        self.model = cfg.model

    def _request(self, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.cfg.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.cfg.url + path, data=data, headers=headers,
                                     method="GET" if body is None else "POST")
        last = None
        for attempt in range(self.cfg.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                if e.code < 500:  # the request itself is refused: retrying will not help
                    raise EndpointError(f"{self.cfg.url}{path} refused the request (HTTP {e.code}): {detail}") from None
                last = f"HTTP {e.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as e:
                last = str(getattr(e, "reason", e))
            if attempt < self.cfg.retries:
                time.sleep(min(2.0**attempt, 30.0))
        raise EndpointError(f"{self.cfg.url}{path} failed after {self.cfg.retries + 1} tries ({last}); is the server "
                            "running and regenerate.endpoint.url right? A re-run resumes from the journal")

    def connect(self) -> str:
        """Check the endpoint answers before any work; pick the served model when none is named."""
        served = [m.get("id") for m in self._request("/models").get("data", [])]
        if self.model is None:
            if not served:
                raise EndpointError(f"{self.cfg.url}/models lists no model; set regenerate.endpoint.model")
            self.model = served[0]
        elif served and self.model not in served:
            raise EndpointError(f"{self.cfg.url} serves {served}, not regenerate.endpoint.model={self.model!r}")
        return self.model

    def complete(self, prompt: list[int], tokenizer, max_tokens: int, temperature: float, top_p: float,
                 seed: int, stop_ids: list[int]) -> Answer:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature, "n": 1,
                "prompt": prompt if self.cfg.prompt_format == "token_ids" else tokenizer.decode(prompt)}
        if temperature > 0:
            body.update(top_p=top_p, seed=seed)
        body.update(self.cfg.extra_body)
        choice = self._request("/completions", body)["choices"][0]
        text = choice.get("text") or ""
        engine_ids = choice.get("token_ids")
        stops = set(stop_ids)
        if engine_ids is not None:
            ids = list(engine_ids)
            cut = next((i for i, t in enumerate(ids) if t in stops), None)
            ids = ids[:cut] if cut is not None else ids
            mismatch = tokenizer(text, add_special_tokens=False)["input_ids"] != ids  # re-tokenizing would differ
            retokenized = False
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            cut = next((i for i, t in enumerate(ids) if t in stops), None)  # an engine that keeps special text
            ids = ids[:cut] if cut is not None else ids
            mismatch = cut is None and tokenizer.decode(ids) != text  # the ids do not give back the engine's text
            retokenized = True
        finished = choice.get("finish_reason") != "length"
        return Answer(ids, finished, retokenized, mismatch)

    def complete_all(self, prompts: list[list[int]], tokenizer, max_tokens: int, temperature: float, top_p: float,
                     seed: int, stop_ids: list[int]) -> list[Answer]:
        """``complete`` for every prompt, ``concurrency`` at a time, in input order."""
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            jobs = [pool.submit(self.complete, p, tokenizer, max_tokens, temperature, top_p, seed + i, stop_ids)
                    for i, p in enumerate(prompts)]
            return [j.result() for j in jobs]
