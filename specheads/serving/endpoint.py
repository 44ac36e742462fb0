"""A server the user already runs (``vllm serve ... --speculative-config ...``): prompts go to its
``/v1/completions`` as token ids, one at a time, greedy; its ``/metrics`` (Prometheus text) is read before and
after each request and differenced (``specheads.serving.counters``). Standard library only.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from specheads.errors import UserError
from specheads.serving.counters import counters_between
from specheads.serving.serve_eval import Decoded


class EndpointError(UserError):
    """The server cannot be reached or answered something unexpected (the message names the URL)."""


def _request(url: str, body: dict | None = None, timeout_s: float = 600) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise EndpointError(f"{url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise EndpointError(f"{url}: cannot reach the server ({getattr(e, 'reason', e)}); start it first, e.g. "
                            "`vllm serve $TARGET --speculative-config '{...}'`, and give its base url (url=http://host:8000)") from None


@dataclass
class EndpointDecoder:
    """A ``Decoder`` over an OpenAI-compatible vLLM server at ``url`` (its base, without /v1)."""

    url: str
    model: str | None = None
    timeout_s: float = 600

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/").removesuffix("/v1")
        if self.model is None:
            models = json.loads(_request(f"{self.url}/v1/models", timeout_s=30)).get("data") or []
            if not models:
                raise EndpointError(f"{self.url}/v1/models lists no model")
            self.model = models[0]["id"]

    def metrics(self) -> str:
        text = _request(f"{self.url}/metrics", timeout_s=30).decode()
        if "vllm:" not in text:
            raise EndpointError(f"{self.url}/metrics holds no vllm:* samples: is it a vLLM server?")
        return text

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Decoded:
        before = self.metrics()
        t = time.perf_counter()
        answer = json.loads(_request(f"{self.url}/v1/completions", {
            "model": self.model, "prompt": list(prompt_ids), "max_tokens": int(max_tokens), "temperature": 0.0,
            "return_token_ids": True}, self.timeout_s))
        seconds = time.perf_counter() - t
        choice = (answer.get("choices") or [{}])[0]
        if "token_ids" not in choice or choice["token_ids"] is None:
            raise EndpointError(f"{self.url}/v1/completions returned no token_ids (vLLM 0.11 or later returns them "
                                "with return_token_ids)")
        return Decoded(list(choice["token_ids"]), choice.get("text", ""), seconds,
                       counters_between(before, self.metrics()))
