"""vLLM's offline engine in a process of its own, run by the engine venv's python (not specheads').

    <engine python> engine_worker.py CONFIG.json     (stdlib and vLLM only: this file imports nothing from specheads)

CONFIG holds ``{"model", "tokenizer", "dtype", "max_model_len", "seed", "speculative_config": {...} | null,
"engine_kwargs": {...}}``. The protocol is JSON lines: requests on stdin, answers on the stdout this process
was started with; everything the engine prints (its log) goes to stderr, which the caller keeps in a file.

    -> {"event": "ready", "load_s": 61.2, "vllm": "0.32.0"}      (or {"event": "error", "stage": "load", ...})
    <- {"op": "generate", "prompt_token_ids": [...], "max_tokens": 32}
    -> {"event": "result", "token_ids": [...], "text": "...", "seconds": 1.9, "metrics_before": "...",
        "metrics_after": "..."}     (metrics: the vllm:* lines of the Prometheus registry, as /metrics serves them)
    <- {"op": "close"}

One prompt per request: a batch of one, greedy (temperature 0), the engine's counters read right before and
right after it, so the caller can difference them per prompt.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _protocol_stream():
    """The original stdout, for answers only; fd 1 then points at stderr (the engine's log)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def _say(proto, **message) -> None:
    proto.write(json.dumps(message) + "\n")
    proto.flush()


def metrics_text() -> str:
    """The vllm:* samples of the in-process Prometheus registry, in its text format."""
    from prometheus_client import REGISTRY, generate_latest

    return "\n".join(line for line in generate_latest(REGISTRY).decode().splitlines()
                     if line.startswith("vllm:"))


def load(config: dict):
    from vllm import LLM

    kwargs = dict(model=config["model"], tokenizer=config.get("tokenizer") or config["model"],
                  dtype=config.get("dtype", "float32"), max_model_len=config.get("max_model_len", 2048),
                  seed=config.get("seed", 0), disable_log_stats=False)
    if config.get("speculative_config"):
        kwargs["speculative_config"] = config["speculative_config"]
    kwargs.update(config.get("engine_kwargs") or {})
    return LLM(**kwargs)


def generate(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]))
    before = metrics_text()
    t = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=list(request["prompt_token_ids"]))], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    completion = out[0].outputs[0]
    return {"event": "result", "token_ids": list(completion.token_ids), "text": completion.text,
            "finish_reason": completion.finish_reason, "seconds": seconds, "metrics_before": before,
            "metrics_after": metrics_text()}


def main(argv: list[str]) -> int:
    proto = _protocol_stream()
    config = json.loads(open(argv[1]).read())
    t = time.perf_counter()
    try:
        import vllm

        llm = load(config)
    except BaseException as e:  # the engine's refusal is the answer: say it, with its type
        traceback.print_exc()
        _say(proto, event="error", stage="load", type=type(e).__name__, message=str(e))
        return 3
    _say(proto, event="ready", load_s=time.perf_counter() - t, vllm=vllm.__version__)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("op") == "close":
            break
        try:
            _say(proto, **generate(llm, request))
        except Exception as e:
            traceback.print_exc()
            _say(proto, event="error", stage="generate", type=type(e).__name__, message=str(e))
    try:
        llm.llm_engine.engine_core.shutdown()  # its engine-core process ends with it
    except Exception:
        traceback.print_exc()
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stderr.flush()
    os._exit(code)  # the engine's background threads and processes must not keep the caller waiting
