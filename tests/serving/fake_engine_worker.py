"""A stand-in for specheads/serving/engine_worker.py (no vLLM): the same JSON-lines protocol and Prometheus
counters, with a deterministic "model". Plain and speculative decoding give the same tokens; the drafter's
first draft is accepted on every step, its later ones never (a chain of k: τ = 2 exactly). A speculative
config whose model path contains "refuse" fails to load as an engine refusing the head does; with "broken"
nothing is accepted and the output differs. ``FAKE_ENGINE_LOAD_S`` makes it sleep that long before it answers
(a plain engine's and a speculative one's, ``FAKE_ENGINE_PLAIN_LOAD_S`` and ``FAKE_ENGINE_SPEC_LOAD_S``, where set);
``FAKE_ENGINE_STARTS`` names a file it appends a line to as it starts and as it is ready (its pid, kind, time);
``FAKE_ENGINE_REFUSE_AFTER`` names the kind a refusing worker waits to see started in that file first (up to 60 s), so
a test of engines started side by side does not depend on which interpreter the machine starts first."""

from __future__ import annotations

import json
import os
import sys
import time

COUNTS = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [], "gen": 0, "requests": 0, "decode_s": 0.0}


def metrics() -> str:
    c = COUNTS
    lab = 'engine="0",model_name="fake"'
    lines = [f"vllm:generation_tokens_total{{{lab}}} {float(c['gen'])}",
             f"vllm:request_decode_time_seconds_count{{{lab}}} {float(c['requests'])}",
             f"vllm:request_decode_time_seconds_sum{{{lab}}} {c['decode_s']}"]
    if SPEC:
        lines += [f"vllm:spec_decode_num_drafts_total{{{lab}}} {float(c['drafts'])}",
                  f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {float(c['draft_tokens'])}",
                  f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {float(c['accepted'])}"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{j}"}} {float(a)}'
                  for j, a in enumerate(c["per_pos"])]
    return "\n".join(lines)


def generate(ids: list[int], n: int) -> dict:
    before = metrics()
    tokens = [(sum(ids) + 7 * i) % 50 + 3 for i in range(n)]
    if BROKEN:
        tokens[-1] += 1
    c = COUNTS
    c["gen"] += n
    c["requests"] += 1
    c["decode_s"] += (n - 1) * (0.01 if SPEC and not BROKEN else 0.02)
    if SPEC:
        steps, left = 0, n - 1  # the prefill gives the first token; each step gives 2 (1 draft accepted + bonus)
        while left > 0:
            steps += 1
            left -= 1 if BROKEN else 2
        c["drafts"] += steps
        c["draft_tokens"] += steps * K
        c["per_pos"] = c["per_pos"] or [0] * K
        if not BROKEN:
            c["accepted"] += steps
            c["per_pos"][0] += steps
    return {"event": "result", "token_ids": tokens, "text": " ".join(map(str, tokens)), "seconds": 0.05,
            "metrics_before": before, "metrics_after": metrics()}


if __name__ == "__main__":
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    config = json.loads(open(sys.argv[1]).read())
    spec = config.get("speculative_config") or {}
    SPEC, K = bool(spec), int(spec.get("num_speculative_tokens", 0))
    BROKEN = "broken" in str(spec.get("model", ""))
    print("fake engine log: loading", config["model"], file=sys.stderr)
    kind = "spec" if SPEC else "plain"
    starts = os.environ.get("FAKE_ENGINE_STARTS")

    def record(event: str) -> None:
        if starts:
            with open(starts, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "kind": kind, "event": event, "t": time.time()}) + "\n")

    record("start")
    time.sleep(float(os.environ.get(f"FAKE_ENGINE_{kind.upper()}_LOAD_S") or os.environ.get("FAKE_ENGINE_LOAD_S") or 0))
    if "refuse" in str(spec.get("model", "")):
        wait_for = os.environ.get("FAKE_ENGINE_REFUSE_AFTER")
        deadline = time.time() + 60
        while wait_for and starts and time.time() < deadline and not any(
                json.loads(line)["kind"] == wait_for for line in open(starts).read().splitlines()):
            time.sleep(0.05)
        proto.write(json.dumps({"event": "error", "stage": "load", "type": "ValueError",
                                "message": "Unsupported speculative method: 'medusa'\nmore lines"}) + "\n")
        sys.exit(3)
    record("ready")
    proto.write(json.dumps({"event": "ready", "load_s": 0.1, "vllm": "0.32.0"}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "close":
            break
        proto.write(json.dumps(generate(request["prompt_token_ids"], request["max_tokens"])) + "\n")
