"""Collection's forward passes done by a serving engine (vLLM) instead of a Hugging Face forward.

``engine_target(...)`` returns an ``EngineTarget``: the target as the store needs to know it (its config, tokenizer,
layer count, hidden size: a model built on the meta device, no weights read) whose ``forward_features`` sends each
batch's rows to vLLM running in the engine venv's own process (``serving/engine_worker.py``, ``capture`` mode). The
engine's worker keeps, for every token of a row's prefill, the inputs of the requested decoder layers, the final
norm's output and the LM head's argmax over it; ``collect_hidden_states`` writes them into the same store
(manifest, shards, checksums, resume, budget, ranks) as the Hugging Face path, so ``train`` cannot tell the two
apart. The captured states match the Hugging Face forward's within the dtype's rounding (``docs/collect.md``).

Each rank starts its own engine over its share of the rows. A row is one request (``max_tokens=1``).
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
from pathlib import Path

import torch

from specheads.engine_process import EngineProcess, engine_settings, find_engine, rank_gpus, worker_cores
from specheads.errors import ConfigError
from specheads.hardware import DTYPES, Choice, cpu_bf16_supported
from specheads.targets import load_tokenizer, resolve_target_path
from specheads.targets.model import Target, TargetFeatures
from specheads.targets.parallel import ParallelLayout, launch_rank_world

log = logging.getLogger(__name__)


class EngineTarget(Target):
    """A ``Target`` whose forward passes run in a serving engine (module doc); ``close()`` stops the engine."""

    def __init__(self, model, tokenizer, name: str, engine_process, aux_layers, need_last: bool, dtype: torch.dtype):
        super().__init__(model, tokenizer, name)
        self.engine = engine_process
        self.engine_dtype = dtype
        self.captured = (tuple(int(i) for i in aux_layers), bool(need_last))
        self._tmp = tempfile.TemporaryDirectory(prefix="specheads-capture-")
        self._calls = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # where the captured states arrive

    @property
    def dtype(self) -> torch.dtype:
        return self.engine_dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an engine-backed target has no LM head here: the engine returns the argmax itself")

    def forward_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         aux_layers=(), need_last: bool = True) -> TargetFeatures:
        """(B, T) right-padded rows -> the engine's states, zero on padding, as the Hugging Face path returns them."""
        from safetensors.torch import load_file

        if tuple(aux_layers) != self.captured[0] or (need_last and not self.captured[1]):
            raise ValueError(f"this engine captures layers {list(self.captured[0])} (last: {self.captured[1]}), "
                             f"asked for {list(aux_layers)} (last: {need_last})")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        lengths = mask.sum(-1).tolist()
        rows = [input_ids[b, :n].tolist() for b, n in enumerate(lengths)]
        self._calls += 1
        path = Path(self._tmp.name) / f"batch{self._calls}.safetensors"
        answer = self.engine.request({"op": "capture", "rows": rows, "path": str(path)}, "captured", "capture states")
        got = load_file(str(path))
        path.unlink()
        B, T = input_ids.shape
        H = self.hidden_size

        def padded(flat: torch.Tensor, width: int | None) -> torch.Tensor:
            out = torch.zeros((B, T, width) if width else (B, T), dtype=flat.dtype)
            start = 0
            for b, n in enumerate(answer["lengths"]):
                out[b, :n] = flat[start:start + n]
                start += n
            return out

        aux = tuple(padded(got[f"aux_{i}"], H) for i in aux_layers)
        last = padded(got["last"], H) if need_last else None
        argmax = padded(got["argmax"].long(), None) if need_last and "argmax" in got else None
        return TargetFeatures(aux=aux, last=last, argmax=argmax)

    def close(self) -> None:
        self.engine.close()
        self._tmp.cleanup()


def engine_dtype(requested: str) -> str:
    """The engine's dtype for ``target.dtype``: as set, or for ``auto`` bfloat16 on a GPU or a CPU with bfloat16
    kernels, else float32."""
    if requested != "auto":
        return str(requested)
    return "bfloat16" if torch.cuda.is_available() or cpu_bf16_supported() else "float32"


def meta_target(name_or_path: str, chat_template: str | None = None) -> Target:
    """The target as a store knows it, built on the meta device (config, layer count, tokenizer; no weights read).
    A .gguf target is refused: vLLM reads a model folder or hub snapshot."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_target_path(name_or_path)
    if not Path(path).is_dir():
        raise ConfigError(f"collect engine=vllm: target '{name_or_path}' resolves to {path}, not a model folder; "
                          "vLLM reads a folder or hub snapshot (a .gguf target collects with engine=hf)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    rank, world = launch_rank_world()  # each rank of a launch collects its share with an engine of its own
    target = Target(model, load_tokenizer(str(path), chat_template), str(name_or_path),
                    layout=ParallelLayout("none", world, rank, 1))
    target.path = str(path)
    return target


def engine_target(meta: Target, aux_layers, need_last: bool, dtype: str = "auto", python: str | None = None,
                  max_model_len: int = 2048, log_dir: str | Path = ".", kv_cache_gib: int | None = None,
                  tensor_parallel_size: int = 1) -> EngineTarget:
    """Start vLLM (the engine venv's python: ``python`` or the one ``find_engine`` finds) on the target ``meta``
    describes, capturing ``aux_layers`` and the last state; refuses, before the engine starts, a layer it lacks."""
    bad = [i for i in aux_layers if not 0 <= int(i) < meta.num_layers]
    if bad:
        raise ConfigError(f"collect engine=vllm: aux layer(s) {bad} out of range for target '{meta.name}' with "
                          f"{meta.num_layers} decoder layers")
    engine = find_engine(python)
    dtype = engine_dtype(dtype)
    run = {"model": meta.path, "tokenizer": meta.path, "dtype": dtype, "max_model_len": int(max_model_len), "seed": 0,
           "engine_kwargs": {"enforce_eager": True, "tensor_parallel_size": int(tensor_parallel_size)},
           "capture": {"layers": [int(i) for i in aux_layers], "last": bool(need_last), "argmax": bool(need_last)}}
    log_path = Path(log_dir) / f"engine_collect_rank{meta.layout.rank}.log"
    log.info("starting vLLM %s on %s (%s) to capture layers %s%s; log %s", engine.version, meta.path, dtype,
             list(aux_layers), " and the last state" if need_last else "", log_path)
    gpus = rank_gpus(tensor_parallel_size)  # before the engine starts: a node short of GPUs is one line
    process = EngineProcess(engine, run, log_path, {**engine_settings(
        engine, threads_bind=worker_cores(tensor_parallel_size), kv_cache_gib=kv_cache_gib), **gpus})
    target = EngineTarget(meta.model, meta.tokenizer, meta.name, process, aux_layers, need_last, DTYPES[dtype])
    target.layout = meta.layout
    target.dtype_choice = Choice(dtype, f"vLLM {engine.version}'s forward")
    return target


def engine_collect_rate(config, architecture: str, aux_layers, need_last: bool, dtype: str = "auto",
                        python: str | None = None, rows: int = 4, row_tokens: int = 512,
                        kv_cache_gib: int | None = 1) -> dict:
    """vLLM's collection rate on this machine for a target of ``config``'s shape (``specheads plan``): the engine
    started on random weights (``load_format=dummy``, no tokenizer, nothing downloaded) with collection's capture,
    one row to warm up, then ``rows`` rows of ``row_tokens`` random ids captured as collection does;
    ``architecture``: the model class vLLM builds (``LlamaForCausalLM``) where the config does not name one.
    Returns ``{"tokens_per_s", "load_s"`` (the engine's start, process included), ``"dtype", "version"}``."""
    engine = find_engine(python)
    dtype = engine_dtype(dtype)
    with tempfile.TemporaryDirectory(prefix="specheads-engine-probe-") as folder:
        described = config.to_dict()
        described["architectures"] = described.get("architectures") or [architecture]
        (Path(folder) / "config.json").write_text(json.dumps(described))
        run = {"model": folder, "tokenizer": folder, "dtype": dtype, "max_model_len": int(row_tokens) + 8, "seed": 0,
               "engine_kwargs": {"enforce_eager": True, "load_format": "dummy", "skip_tokenizer_init": True},
               "capture": {"layers": [int(i) for i in aux_layers], "last": bool(need_last), "argmax": bool(need_last)}}
        with EngineProcess(engine, run, Path(folder) / "engine.log",
                           engine_settings(engine, threads_bind=worker_cores(), kv_cache_gib=kv_cache_gib)) as process:
            vocab = int(config.vocab_size)
            rng = random.Random(0)
            ids = [[rng.randrange(vocab) for _ in range(int(row_tokens))] for _ in range(int(rows) + 1)]
            process.request({"op": "capture", "rows": ids[:1], "path": str(Path(folder) / "w.safetensors")},
                            "captured", "warm up")
            got = process.request({"op": "capture", "rows": ids[1:], "path": str(Path(folder) / "p.safetensors")},
                                  "captured", "time a collection batch")
            load_s = process.wall_load_s
    return {"tokens_per_s": int(rows) * int(row_tokens) / got["seconds"], "load_s": load_s, "dtype": dtype,
            "version": engine.version}
