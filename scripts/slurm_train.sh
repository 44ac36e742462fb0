#!/usr/bin/env bash
# Hidden-state collection, then draft-head training, on several nodes with Slurm: one task per node,
# each task runs `accelerate launch` for its node's GPUs; rendezvous (static) at the job's first node.
#
#   sbatch --nodes 2 scripts/slurm_train.sh /models/Llama-3.1-8B-Instruct runs/llama8b [train overrides...]
#   METHOD=medusa1 TARGET_PARALLEL=none sbatch --nodes 4 scripts/slurm_train.sh /models/m runs/m train.max_steps=5000
#
# Needs this repository (with .venv from scripts/setup.sh) at the same path on every node, and RUN_DIR on
# a filesystem every node sees (each node writes its share of the feature store there; the last rank to
# finish writes the manifest). Stages: prepare (once, first node; skipped if RUN_DIR/prepared exists),
# collect (TARGET_PARALLEL=tp: a process per GPU, the target split over each node's GPUs by tensor
# parallelism, a node reading one share of the data; device_map: one process per node spreading the
# target's layers over the node's GPUs; none: a whole target per GPU), train (a process per GPU, data
# parallel over all of them, from the store).
# Environment: METHOD (eagle3), TARGET_PARALLEL (tp | device_map | none; default tp), GPUS_PER_NODE
# (Slurm's count on the node, else 8), MASTER_PORT (29500; training uses the next port),
# LAUNCH_CONFIG (conf/launcher/accelerate.yaml), ACCELERATE (.venv/bin/accelerate), PYTHON (.venv/bin/python).
#
#SBATCH --job-name=specheads
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

MODEL=${1:?usage: sbatch scripts/slurm_train.sh MODEL RUN_DIR [train overrides...]}
RUN_DIR=${2:?usage: sbatch scripts/slurm_train.sh MODEL RUN_DIR [train overrides...]}
shift 2
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"

export METHOD=${METHOD:-eagle3}
export TARGET_PARALLEL=${TARGET_PARALLEL:-tp}
export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export LAUNCH_CONFIG=${LAUNCH_CONFIG:-conf/launcher/accelerate.yaml}
export ACCELERATE=${ACCELERATE:-.venv/bin/accelerate}
PYTHON=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
NODES=${SLURM_NNODES:?run under Slurm (sbatch / salloc)}
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${MASTER_PORT:-29500}
TARGET=("target=hf" "target.name_or_path=$MODEL" "target.parallel=$TARGET_PARALLEL")

# launch PORT PROCESSES_PER_NODE SCRIPT ARGS...: one `accelerate launch` per node, the node's rank being
# Slurm's SLURM_NODEID (read inside the task); --num_processes counts the processes of all nodes.
launch() {
  local port=$1 per_node=$2
  shift 2
  srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash -c 'exec "$ACCELERATE" launch --config_file "$LAUNCH_CONFIG" --num_machines "$SLURM_NNODES" \
      --machine_rank "$SLURM_NODEID" --main_process_ip "$MASTER_ADDR" --main_process_port "$0" \
      --num_processes "$1" "${@:2}"' "$port" "$((NODES * per_node))" "$@"
}

if [ ! -f "$RUN_DIR/prepared/specheads_meta.json" ]; then
  srun --nodes=1 --ntasks=1 "$PYTHON" recipes/prepare_data.py "${TARGET[@]:0:2}" "output_dir=$RUN_DIR/prepared"
fi
# device_map: one process per node holds the target spread over all the node's GPUs.
COLLECT_PER_NODE=$GPUS_PER_NODE
[ "$TARGET_PARALLEL" = device_map ] && COLLECT_PER_NODE=1
launch "$PORT" "$COLLECT_PER_NODE" recipes/collect_hidden_states.py "${TARGET[@]}" "method=$METHOD" \
  "prepared_dir=$RUN_DIR/prepared" "output_dir=$RUN_DIR/features"
launch "$((PORT + 1))" "$GPUS_PER_NODE" recipes/train.py "${TARGET[@]:0:2}" "method=$METHOD" \
  "prepared_dir=$RUN_DIR/prepared" "features_dir=$RUN_DIR/features" "output_dir=$RUN_DIR/train/$METHOD" "$@"
