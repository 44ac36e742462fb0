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
(``specheads.data.engine_features``): hooks in its worker keep the inputs of the listed decoder layers (the
residual stream: vLLM hands a layer ``hidden_states`` and ``residual`` apart, their sum is the state), the final
norm's output and the LM head's argmax over it, for every token a step computes, and a record per step of which
request and position each token is (so rows share steps, and a row split over steps is put back together):

    <- {"op": "capture", "rows": [[ids...], ...], "path": "/tmp/x.safetensors", "salts": [...] | null}
    -> {"event": "captured", "path": "...", "lengths": [...], "reused": 0, "seconds": 0.4}
       (the file: aux_{i} (sum T, H) per layer, last (sum T, H), argmax (sum T,), rows one after another)

Each row is a request with ``max_tokens=1``, so its prefill is the row. With ``"prefix_caching": true`` the engine
also answers and keeps what answering computed (``specheads.data.engine_answers``, ``regenerate=engine``):

    <- {"op": "answer", "prompts": [[ids...]], "salts": ["chat", ...], "max_tokens": 256 | [...], "temperature": 0.0,
        "top_p": 1.0, "seed": 0, "stop_token_ids": [...]}
    -> {"event": "answers", "answers": [{"token_ids": [...], "finish_reason": "stop"}], "seconds": 3.1}

A prompt's salt is its chat's ``cache_salt``: a later ``capture`` of the chat's rendered rows with the same salts
reuses the chat's own cached blocks, computes only the rest, and takes each position's state from the latest
request that computed it after the row's own tokens (``reused`` counts those); ``release`` lists chats whose kept
states may go. Without prefix caching (collection) no position comes from a cache.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback


PARENT_ENV = "SPECHEADS_ENGINE_PARENT"  # the pid of the process that started the worker (``EngineProcess``)


def die_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """End this process and its children (the engine-core process) once ``parent``, the process that started this
    one, is gone, killed or ended without a close: a vLLM engine must not outlive the run that asked for it. Only in
    a process that leads its own group (``EngineProcess`` starts it in a new session): no other group is ours."""
    if os.getpgrp() != os.getpid():
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


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
    """Runs in the engine's worker (``collective_rpc``): forward hooks that keep the states of every token a step
    computes, and a record per step of whose tokens they are (request ids, first position, token counts, in the
    order the runner lays the step's tokens out)."""
    runner = worker.model_runner
    inner = runner.model.model
    kept: dict = {"steps": []}
    worker._specheads_capture = kept
    prepare = runner._prepare_inputs

    def recording_prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        batch = runner.input_batch
        n = batch.num_reqs
        kept["steps"].append((list(batch.req_ids[:n]), [int(x) for x in batch.num_computed_tokens_cpu[:n]],
                              [int(x) for x in num_scheduled_tokens[:n]]))
        return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

    runner._prepare_inputs = recording_prepare

    def step_tokens() -> int:  # the step's real tokens (a runner may pad its input)
        return sum(kept["steps"][-1][2]) if kept["steps"] else 0

    def layer_input(i):
        def hook(module, args, kwargs):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
            r = kwargs["residual"] if "residual" in kwargs else (args[2] if len(args) > 2 else None)
            n = step_tokens()
            kept.setdefault(f"aux_{i}", []).append((h[:n] if r is None else h[:n] + r[:n]).detach().cpu())
        return hook

    for i in layers:
        inner.layers[i].register_forward_pre_hook(layer_input(i), with_kwargs=True)
    if last:
        def final_norm(module, args, out):
            kept.setdefault("last", []).append((out[0] if isinstance(out, tuple) else out)[:step_tokens()].detach())
        inner.norm.register_forward_hook(final_norm)
    return len(inner.layers)


def _take_capture(worker, argmax: bool) -> dict:
    """Runs in the engine's worker: what the hooks kept since the last call (the steps' layout, the states and the
    LM head's argmax over the final norm's output, in row chunks), cleared."""
    import torch

    kept = worker._specheads_capture
    out = {k: torch.cat(v) for k, v in kept.items() if k not in ("last", "steps")}
    out["steps"] = list(kept["steps"])
    if "last" in kept:
        last = torch.cat(kept["last"])
        if argmax:
            with torch.no_grad():
                out["argmax"] = torch.cat([worker.model_runner.model.compute_logits(last[i:i + 1024]).argmax(-1).cpu()
                                           for i in range(0, len(last), 1024)] or [torch.zeros(0, dtype=torch.long)])
        out["last"] = last.cpu()
    kept.clear()
    kept["steps"] = []
    return out


def _per_request(got: dict) -> dict:
    """{internal request id: {"pos": positions, key: states}} from one ``_take_capture``: each step's tokens
    split by request, in the runner's layout."""
    import torch

    keys = [k for k in got if k != "steps"]
    pieces: dict = {}
    at = 0
    for req_ids, starts, counts in got["steps"]:
        for rid, start, n in zip(req_ids, starts, counts):
            if n:
                rec = pieces.setdefault(rid, {"pos": [], **{k: [] for k in keys}})
                rec["pos"].append(torch.arange(start, start + n))
                for k in keys:
                    rec[k].append(got[k][at:at + n])
            at += n
    for k in keys:
        if len(got[k]) != at:
            raise RuntimeError(f"captured {len(got[k])} states of {k} for {at} scheduled tokens")
    return {rid: {k: torch.cat(v) for k, v in rec.items()} for rid, rec in pieces.items()}


def _internal_ids(outputs, per: dict) -> list[str | None]:
    """The worker's id of each output's request (vLLM adds a random suffix to the caller's id)."""
    by_external = {rid.rsplit("-", 1)[0]: rid for rid in per}
    return [out.request_id if out.request_id in per else by_external.get(out.request_id) for out in outputs]


class Captures:
    """The states of a chat's generation requests, kept in this process until its rows are captured: position p of
    a row takes the state of the latest request that computed p after the row's own first p+1 tokens."""

    def __init__(self):
        self.by_salt: dict[str, list] = {}
        self.reused = 0  # positions of assembled rows whose states came from a generation request

    def keep(self, salt: str, ids: list[int], states: dict) -> None:
        self.by_salt.setdefault(salt, []).append((ids, states))

    def assemble(self, row: list[int], salt: str | None, tail: dict | None) -> dict:
        import torch

        n = len(row)
        sources = list(self.by_salt.get(salt, [])) if salt is not None else []
        if tail is not None:
            sources.append((row, tail))
        keys = [k for k in (tail or (sources[-1][1] if sources else {})) if k != "pos"]
        out: dict = {}
        filled = torch.zeros(n, dtype=torch.bool)
        for ids, states in reversed(sources):  # the newest first
            same = 0
            for a, b in zip(ids, row):
                if a != b:
                    break
                same += 1
            pos = states["pos"]
            use = (pos < same) & ~filled[pos.clamp(max=n - 1)] & (pos < n)
            if not bool(use.any()):
                continue
            for k in keys:
                v = states[k][use]
                if k not in out:
                    out[k] = torch.zeros((n, *v.shape[1:]), dtype=v.dtype)
                out[k][pos[use]] = v
            filled[pos[use]] = True
            if ids is not row:
                self.reused += int(use.sum())
        if not bool(filled.all()):
            missing = (~filled).nonzero().flatten().tolist()
            raise RuntimeError(f"no captured state for positions {missing[:8]} of a {n}-token row")
        return out

    def release(self, salts) -> None:
        for s in salts:
            self.by_salt.pop(s, None)


CAPTURES = Captures()


def _prompt(ids, salt):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids), **({"cache_salt": salt} if salt else {}))


def capture(llm, config: dict, request: dict) -> dict:
    """Prefill each row (several per engine step; ``salts``: a row's chat, whose generation states already held
    are reused where its prefix is cached) and write every position's states, rows one after another."""
    from safetensors.torch import save_file
    from vllm import SamplingParams

    import torch

    rows, salts = request["rows"], request.get("salts") or [None] * len(request["rows"])
    t = time.perf_counter()
    CAPTURES.reused = 0
    parts: dict = {}
    if rows:
        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        outs = llm.generate([_prompt(r, s) for r, s in zip(rows, salts)], params, use_tqdm=False)
        per = _per_request(llm.collective_rpc(_take_capture, args=(bool(config["capture"].get("argmax")),))[0])
        for row, salt, rid in zip(rows, salts, _internal_ids(outs, per)):
            for k, v in CAPTURES.assemble(row, salt, per.get(rid)).items():
                parts.setdefault(k, []).append(v)
    CAPTURES.release([s for s in salts if s is not None] + list(request.get("release") or []))
    save_file({k: torch.cat(v).contiguous() for k, v in parts.items()}, request["path"])
    return {"event": "captured", "path": request["path"], "lengths": [len(r) for r in rows],
            "reused": CAPTURES.reused, "seconds": time.perf_counter() - t}


def answer(llm, config: dict, request: dict) -> dict:
    """Generate an answer to each prompt in one batch (greedy, or sampled with a seed per prompt); with capture on,
    the states every step computed are kept under the prompt's salt for a later ``capture``."""
    from vllm import SamplingParams

    t = time.perf_counter()
    temperature, seed = float(request.get("temperature", 0.0)), int(request.get("seed", 0))
    caps = request["max_tokens"]  # one for all prompts, or one per prompt
    caps = caps if isinstance(caps, list) else [caps] * len(request["prompts"])
    params = [SamplingParams(temperature=temperature, top_p=float(request.get("top_p", 1.0)), max_tokens=int(cap),
                             stop_token_ids=list(request.get("stop_token_ids") or []),
                             seed=(seed + i) if temperature > 0 else None, detokenize=False)
              for i, cap in enumerate(caps)]
    salts = request.get("salts") or [None] * len(request["prompts"])
    outs = llm.generate([_prompt(p, s) for p, s in zip(request["prompts"], salts)], params, use_tqdm=False)
    if config.get("capture"):
        per = _per_request(llm.collective_rpc(_take_capture, args=(bool(config["capture"].get("argmax")),))[0])
        for out, prompt, salt, rid in zip(outs, request["prompts"], salts, _internal_ids(outs, per)):
            if salt is not None and rid in per:
                CAPTURES.keep(salt, list(prompt) + list(out.outputs[0].token_ids), per[rid])
    answers = [{"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason} for o in outs]
    return {"event": "answers", "answers": answers, "seconds": time.perf_counter() - t}


def load(config: dict):
    from vllm import LLM

    kwargs = dict(model=config["model"], tokenizer=config.get("tokenizer") or config["model"],
                  dtype=config.get("dtype", "float32"), max_model_len=config.get("max_model_len", 2048),
                  seed=config.get("seed", 0), disable_log_stats=False)
    if config.get("speculative_config"):
        kwargs["speculative_config"] = config["speculative_config"]
    kwargs.update(config.get("engine_kwargs") or {})
    if config.get("capture"):  # a chat's own cached prefix only (each request carries its chat as cache salt)
        kwargs.update(enable_prefix_caching=bool(config["capture"].get("prefix_caching")),
                      max_num_batched_tokens=max(kwargs["max_model_len"], int(config["capture"].get("step_tokens", 0))))
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
    die_with_parent(int(os.environ.get(PARENT_ENV) or os.getppid()))
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
            elif request.get("op") == "answer":
                _say(proto, **answer(llm, config, request))
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
