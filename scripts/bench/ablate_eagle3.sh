#!/usr/bin/env bash
# One row of the EAGLE-3 ablation table (docs/ablations.md): train EAGLE-3 on a run's feature store for a time budget with the
# quickstart's settings plus the given overrides, then print the held-out figures (top-1 per step against
# the target's argmax on training-side held-out chats, and the measured chain-3 tau on held-out prompts).
#   bash scripts/bench/ablate_eagle3.sh NAME RUN_DIR MINUTES [overrides...]
#   bash scripts/bench/ablate_eagle3.sh ttt1 runs/quickstart 4 method.ttt_steps=1
#   bash scripts/bench/ablate_eagle3.sh freeze runs/quickstart 4 method.init_lm_head_from_target=true method.freeze_lm_head=true
# Output: runs/ablate/NAME (train_summary.json, metrics.jsonl) and one line on stdout. Run one at a time.
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,8p "$0"; exit 2; }
name=$1; run=$2; mins=$3; shift 3
cd "$(dirname "$0")/../.."
out=runs/ablate/$name
mkdir -p runs/ablate
.venv/bin/python recipes/train.py method=eagle3 features_dir="$run/features" prepared_dir="$run/prepared" output_dir="$out" \
  method.draft_vocab_size=4096 method.ttt_steps=1 optim.lr=3e-3 optim.warmup_steps=10 train.max_steps=100000 \
  train.max_minutes="$mins" train.mixed_precision=bf16 train.eval_every=0 train.save_every=100000 data.max_tokens=2048 \
  data.eval_samples=24 train.resume=never train.progress=false wandb.mode=disabled "$@" > "$out.log" 2>&1
.venv/bin/python - "$out" "$name" <<'PY'
import json, sys
s = json.load(open(f"{sys.argv[1]}/train_summary.json")); e = s["eval"]
steps = " ".join(f"step{i} {e[f'step{i}_acc']:.3f}" for i in range(8) if f"step{i}_acc" in e)
steps += "".join(f" on-path{i} {e[f'onpath{i}_acc']:.3f}" for i in range(8) if f"onpath{i}_acc" in e)
print(f"{sys.argv[2]}: {s['steps']} steps, {s['tokens_per_s']:.0f} tokens/s, peak RSS {s['peak_rss_mb']:.0f} MB "
      f"(anonymous {s.get('peak_anon_mb') or float('nan'):.0f}) | "
      f"held-out {steps} | measured chain tau {e.get('measured_tau', float('nan')):.3f}")
PY
