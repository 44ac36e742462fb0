"""Collection through vLLM against the transformers forward, on the device at hand (``gpu_check.sh``'s engine part).

    python scripts/engine_collect_check.py                    # a GPU when there is one, else the CPU
    python scripts/engine_collect_check.py --device cpu --engine-python .venv-vllm/bin/python

A small random Llama (saved to a temporary folder: nothing downloaded, no tokenizer) goes through both: the
transformers forward here (``Target.forward_features``) and vLLM capturing as ``collect engine=vllm`` does
(``serving/engine_worker.py``: several rows per engine step, each put back together from its positions). In
float32 every fused-layer input and last state must agree within 1e-4 of the row's largest state in that layer,
and the LM head's argmax must agree wherever the forward's top two logits are more than 1e-4 apart. Then both
time a larger batch (tokens/s). Prints a JSON report; exit 0 all agree, 1 a mismatch or a crash, 3 no vLLM here.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--engine-python", help="a python that imports vLLM (default: this one if it does, else the "
                                           "engine venv that specheads finds)")
    p.add_argument("--rows", type=int, default=16, help="rows of the timed batch")
    p.add_argument("--row-tokens", type=int, default=256)
    return p.parse_args(argv)


def engine_python(given: str | None):
    """The python to run vLLM with, or None when there is none."""
    import importlib.util

    from specheads.serving.engine import EngineNotFoundError, find_engine

    if given:
        return find_engine(given)
    if importlib.util.find_spec("vllm") is not None:
        return find_engine(sys.executable)
    try:
        return find_engine(None)
    except EngineNotFoundError:
        return None


def main(argv=None) -> int:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from specheads.serving.engine import EngineProcess, engine_settings, worker_cores
    from specheads.targets import Target

    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    engine = engine_python(args.engine_python)
    if engine is None:
        print(json.dumps({"engine_collect": "not run: no python with vLLM here"}))
        return 3
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=1024, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=2048, tie_word_embeddings=False,
                                  architectures=["LlamaForCausalLM"])
    model = AutoModelForCausalLM.from_config(config).eval()
    layers = [1, 2, 3]
    report: dict = {"device": device, "vllm": engine.version}
    with tempfile.TemporaryDirectory(prefix="engine-collect-check-") as folder:
        model.save_pretrained(folder)
        target = Target(model.to(device), None, "tiny-llama")
        gen = torch.Generator().manual_seed(1)
        lengths = [37, 64, 5, 200, 129, 90]
        rows = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in lengths]
        run = {"model": folder, "tokenizer": folder, "dtype": "float32", "max_model_len": 1024, "seed": 0,
               "engine_kwargs": {"enforce_eager": True, "skip_tokenizer_init": True, "max_num_seqs": 64},
               "capture": {"layers": layers, "last": True, "argmax": True, "step_tokens": 256}}
        with EngineProcess(engine, run, Path(folder) / "engine.log",
                           engine_settings(engine, threads_bind=worker_cores(), kv_cache_gib=1)) as process:
            got = process.request({"op": "capture", "rows": rows, "path": f"{folder}/c.safetensors"}, "captured",
                                  "capture states")
            flat = load_file(f"{folder}/c.safetensors")
            worst, ties, mismatched, at = 0.0, 0, 0, 0
            for row in rows:
                ids = torch.tensor([row], device=device)
                with torch.no_grad():
                    ref = target.forward_features(ids, None, aux_layers=layers, need_last=True)
                    logits = target.logits(ref.last[0]).float()
                n = len(row)
                for j, i in enumerate(layers):
                    a, b = ref.aux[j][0].float().cpu(), flat[f"aux_{i}"][at:at + n].float()
                    worst = max(worst, float(((a - b).abs() / a.abs().amax(-1, keepdim=True)).max()))
                a, b = ref.last[0].float().cpu(), flat["last"][at:at + n].float()
                worst = max(worst, float(((a - b).abs() / a.abs().amax(-1, keepdim=True)).max()))
                top2 = logits.topk(2, -1).values
                near = (top2[:, 0] - top2[:, 1]).cpu() <= 1e-4
                differ = logits.argmax(-1).cpu() != flat["argmax"][at:at + n].long()
                ties += int((differ & near).sum())
                mismatched += int((differ & ~near).sum())
                at += n
            report.update(rows=len(rows), tokens=at, captured=got["lengths"] == lengths,
                          worst_state_diff_of_row_max=worst, argmax_mismatches=mismatched, argmax_near_ties=ties)
            big = [torch.randint(0, 1024, (args.row_tokens,), generator=gen).tolist() for _ in range(args.rows)]
            timed = process.request({"op": "capture", "rows": big, "path": f"{folder}/t.safetensors"}, "captured",
                                    "time a batch")
            report["engine_tokens_per_s"] = round(args.rows * args.row_tokens / timed["seconds"])
        ids = torch.tensor(big, device=device)
        with torch.no_grad():
            target.forward_features(ids[:2], None, aux_layers=layers, need_last=True)  # warm up
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            feats = target.forward_features(ids, None, aux_layers=layers, need_last=True)
            target.logits(feats.last).argmax(-1)
            if device == "cuda":
                torch.cuda.synchronize()
        report["transformers_tokens_per_s"] = round(args.rows * args.row_tokens / (time.perf_counter() - t))
    ok = report["captured"] and worst <= 1e-4 and mismatched == 0
    report["match"] = ok
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # a crash is a failed check, with its trace
        import traceback

        traceback.print_exc()
        sys.exit(1)
