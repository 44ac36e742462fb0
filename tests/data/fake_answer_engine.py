"""A stand-in for specheads/serving/engine_worker.py's answer and capture modes (no vLLM): the same JSON-lines
protocol with a deterministic "model", for regeneration's resume tests (``regenerate=engine`` with capture).

An answer is a few ids and the first stop id, drawn from the prompt's ids (greedy) or from the prompt and the
request's seed (sampled: ``seed + i`` for the batch's i-th prompt, as the real worker seeds vLLM); a row's states
at position p are a function of its ids up to p (as a causal model's are), in the engine's dtype, with the
config's hidden size and layers."""

from __future__ import annotations

import json
import os
import random
import sys

import torch
from safetensors.torch import save_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prefix_codes(ids: list[int]) -> list[int]:
    code, out = 17, []
    for t in ids:
        code = (code * 1000003 + int(t) + 1) % (1 << 61)
        out.append(code)
    return out


def answer(request: dict) -> dict:
    prompts, temperature, seed = request["prompts"], float(request["temperature"]), int(request["seed"])
    caps = request["max_tokens"] if isinstance(request["max_tokens"], list) else [request["max_tokens"]] * len(prompts)
    stop = list(request["stop_token_ids"])[0]
    answers = []
    for i, (prompt, cap) in enumerate(zip(prompts, caps)):
        code = prefix_codes(prompt)[-1]
        rng = random.Random(f"{code}:{seed + i}" if temperature > 0 else str(code))
        ids = [rng.randrange(1000, 5000) for _ in range(rng.randint(2, 9))] + [stop]
        answers.append({"token_ids": ids[:cap], "finish_reason": "stop" if len(ids) <= cap else "length"})
    return {"event": "answers", "answers": answers, "seconds": 0.0}


def capture(config: dict, request: dict) -> dict:
    model = json.loads(open(os.path.join(config["model"], "config.json")).read())
    H, vocab = int(model["hidden_size"]), int(model["vocab_size"])
    dtype = DTYPES[config["dtype"]]
    cap = config["capture"]
    parts: dict[str, list[torch.Tensor]] = {}
    for row in request["rows"]:
        codes = torch.tensor([c % 10007 for c in prefix_codes(row)], dtype=torch.float64)
        freq = torch.arange(1, H + 1, dtype=torch.float64) * 1e-3
        for name, shift in [(f"aux_{i}", float(i)) for i in cap["layers"]] + ([("last", -1.0)] if cap["last"] else []):
            parts.setdefault(name, []).append(torch.sin(codes[:, None] * freq + shift).to(dtype))
        if cap.get("argmax"):
            parts.setdefault("argmax", []).append(torch.tensor([c % vocab for c in prefix_codes(row)]))
    save_file({k: torch.cat(v).contiguous() for k, v in parts.items()}, request["path"])
    return {"event": "captured", "path": request["path"], "lengths": [len(r) for r in request["rows"]],
            "reused": 0, "seconds": 0.0}


if __name__ == "__main__":
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    config = json.loads(open(sys.argv[1]).read())
    proto.write(json.dumps({"event": "ready", "load_s": 0.0, "vllm": "0.0.fake"}) + "\n")
    for line in sys.stdin:  # the run that started it gone (killed): stdin ends, and so does this process
        request = json.loads(line)
        if request["op"] == "close":
            break
        proto.write(json.dumps(answer(request) if request["op"] == "answer" else capture(config, request)) + "\n")
