"""``recipes/train.py`` with two test-only knobs, for launches that need them (never for the main evidence):

    accelerate launch --config_file conf/launcher/cpu_ddp.yaml --num_processes 2 tests/distributed/train_entry.py <overrides>

SPECHEADS_TEST_SLEEP=S        sleep S seconds before each micro-batch (so a test can kill a rank mid-run;
                              numbers are unchanged)
SPECHEADS_TEST_NO_GRAD_SYNC=1 give the DDP wrapper a communication hook that keeps each rank's own
                              gradient (no all-reduce): the negative control of the equivalence test

Everything else is the recipe itself (its Hydra ``main``, the same overrides and outputs).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "train.py"


def _slow_batches(seconds: float) -> None:
    import specheads.training.engine as engine

    inner = engine.prepare_batch

    def prepare_batch(*args, **kwargs):
        time.sleep(seconds)
        return inner(*args, **kwargs)

    engine.prepare_batch = prepare_batch


def _local_gradients_only() -> None:
    import torch
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    def keep_local(state, bucket):  # DDP's hook contract: a future holding the bucket's "reduced" gradients
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    prepare = Accelerator.prepare

    def prepare_without_sync(self, *args, **kwargs):
        out = prepare(self, *args, **kwargs)
        for obj in out if isinstance(out, tuple) else (out,):
            if isinstance(obj, DistributedDataParallel):
                obj.register_comm_hook(None, keep_local)
                print(f"[train_entry] rank {self.process_index}: DDP gradient all-reduce switched off", flush=True)
        return out

    Accelerator.prepare = prepare_without_sync


def main() -> None:
    if float(os.environ.get("SPECHEADS_TEST_SLEEP", "0")) > 0:
        _slow_batches(float(os.environ["SPECHEADS_TEST_SLEEP"]))
    if os.environ.get("SPECHEADS_TEST_NO_GRAD_SYNC") == "1":
        _local_gradients_only()
    sys.argv[0] = str(RECIPE)  # Hydra finds ../conf from the recipe's own file, as when it is run directly
    runpy.run_path(str(RECIPE), run_name="__main__")


if __name__ == "__main__":
    main()
