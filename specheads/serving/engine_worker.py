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

With ``"capture": {"layers": [...], "last": true, "argmax": true}`` in CONFIG the engine collects hidden states
instead (``specheads.data.engine_features``): hooks in its worker keep the inputs of the listed decoder layers (the
residual stream: vLLM hands a layer ``hidden_states`` and ``residual`` apart, their sum is the state), the final
norm's output and the LM head's argmax over it, for every token a prefill computes:

    <- {"op": "capture", "rows": [[ids...], ...], "path": "/tmp/x.safetensors"}
    -> {"event": "captured", "path": "...", "lengths": [...], "seconds": 0.4}
       (the file: aux_{i} (sum T, H) per layer, last (sum T, H), argmax (sum T,), rows one after another)

Each row is one request with ``max_tokens=1``, so the prefill is the row; prefix caching is off (a cached prefix
would not be computed) and a step takes a whole row (``max_num_batched_tokens`` = ``max_model_len``).
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


def _install_capture(worker, layers: list[int], last: bool) -> int:
    """Runs in the engine's worker (``collective_rpc``): forward hooks that keep the states of every token."""
    inner = worker.model_runner.model.model
    kept: dict = {}
    worker._specheads_capture = kept

    def layer_input(i):
        def hook(module, args, kwargs):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
            r = kwargs["residual"] if "residual" in kwargs else (args[2] if len(args) > 2 else None)
            kept.setdefault(f"aux_{i}", []).append((h if r is None else h + r).detach().float().cpu())
        return hook

    for i in layers:
        inner.layers[i].register_forward_pre_hook(layer_input(i), with_kwargs=True)
    if last:
        def final_norm(module, args, out):
            kept.setdefault("last", []).append((out[0] if isinstance(out, tuple) else out).detach())
        inner.norm.register_forward_hook(final_norm)
    return len(inner.layers)


def _take_capture(worker, argmax: bool) -> dict:
    """Runs in the engine's worker: what the hooks kept since the last call (and the LM head's argmax), cleared."""
    import torch

    kept = worker._specheads_capture
    out = {k: torch.cat(v) for k, v in kept.items() if not k == "last"}
    if "last" in kept:
        last = torch.cat(kept["last"])
        if argmax:
            with torch.no_grad():
                out["argmax"] = worker.model_runner.model.compute_logits(last).argmax(-1).cpu()
        out["last"] = last.float().cpu()
    kept.clear()
    return out


def capture(llm, config: dict, request: dict) -> dict:
    from safetensors.torch import save_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1)
    t = time.perf_counter()
    parts: dict = {}
    lengths = []
    for row in request["rows"]:
        llm.generate([TokensPrompt(prompt_token_ids=list(row))], params, use_tqdm=False)
        got = llm.collective_rpc(_take_capture, args=(bool(config["capture"].get("argmax")),))[0]
        n = len(row)
        for k, v in got.items():
            if v.shape[0] != n:
                raise RuntimeError(f"captured {v.shape[0]} states of {k} for a row of {n} tokens (was the prefill "
                                   "split or cached?)")
            parts.setdefault(k, []).append(v)
        lengths.append(n)
    import torch

    save_file({k: torch.cat(v).contiguous() for k, v in parts.items()}, request["path"])
    return {"event": "captured", "path": request["path"], "lengths": lengths, "seconds": time.perf_counter() - t}


def load(config: dict):
    from vllm import LLM

    kwargs = dict(model=config["model"], tokenizer=config.get("tokenizer") or config["model"],
                  dtype=config.get("dtype", "float32"), max_model_len=config.get("max_model_len", 2048),
                  seed=config.get("seed", 0), disable_log_stats=False)
    if config.get("speculative_config"):
        kwargs["speculative_config"] = config["speculative_config"]
    kwargs.update(config.get("engine_kwargs") or {})
    if config.get("capture"):  # every token of a row computed in one step, none from a cache
        kwargs.update(enable_prefix_caching=False, max_num_batched_tokens=kwargs["max_model_len"])
    llm = LLM(**kwargs)
    if config.get("capture"):
        llm.collective_rpc(_install_capture, args=(list(config["capture"].get("layers") or []),
                                                   bool(config["capture"].get("last"))))
    return llm


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
    if config.get("capture"):  # the hooks go to the engine's worker process as pickled functions
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
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
            if request.get("op") == "capture":
                _say(proto, **capture(llm, config, request))
            else:
                _say(proto, **generate(llm, request))
        except Exception as e:
            traceback.print_exc()
            _say(proto, event="error", stage=request.get("op", "generate"), type=type(e).__name__, message=str(e))
    try:
        llm.llm_engine.engine_core.shutdown()  # its engine-core process ends with it
    except Exception:
        traceback.print_exc()
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stderr.flush()
    os._exit(code)  # the engine's background threads and processes must not keep the caller waiting
