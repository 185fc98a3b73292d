#!/bin/bash
# Multi-node training under SLURM: srun starts one `accelerate launch` per node, which starts one
# training process per GPU; node 0 hosts the rendezvous. Submit from the repository root:
#
#   sbatch accelerate_configs/slurm_multinode.sh configs/wan2_1_t2v_1_3b_dfsft.yaml train_dfsft.py
#   sbatch --nodes=4 accelerate_configs/slurm_multinode.sh configs/wan2_1_t2v_1_3b_sft.yaml train_finetune.py \
#       --training.optimizer.learning_rate 2e-6
#   ACCEL_CONFIG=accelerate_configs/deepspeed_zero3.yaml sbatch accelerate_configs/slurm_multinode.sh ...
#
# Arguments: RECIPE [ENTRY (train_finetune.py)] [recipe options ...]. Environment: ACCEL_CONFIG
# (accelerate_configs/fsdp2.yaml), GPUS_PER_NODE (8), MAIN_PORT (29500), ACCELERATE (accelerate).
# The run always passes --resume_from_checkpoint latest: a requeued job continues from its last
# checkpoint (a first run starts fresh). SIGTERM arrives 5 minutes before the time limit; the
# trainer finishes its step, saves a checkpoint and exits (README "Checkpoints, resume and faults").
#SBATCH --job-name=fv_accel
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=TERM@300
#SBATCH --requeue
set -euo pipefail

RECIPE=${1:?usage: sbatch accelerate_configs/slurm_multinode.sh RECIPE.yaml [ENTRY] [--section.key VALUE ...]}
ENTRY=${2:-train_finetune.py}
shift $(( $# >= 2 ? 2 : 1 ))
ACCEL_CONFIG=${ACCEL_CONFIG:-accelerate_configs/fsdp2.yaml}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAIN_PORT=${MAIN_PORT:-29500}
ACCELERATE=${ACCELERATE:-accelerate}
NUM_MACHINES=${SLURM_NNODES:?run this under sbatch}
NUM_PROCESSES=$(( NUM_MACHINES * GPUS_PER_NODE ))
MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

LAUNCH_ARGS=(--config_file "$ACCEL_CONFIG" --num_machines "$NUM_MACHINES" --num_processes "$NUM_PROCESSES"
             --main_process_ip "$MAIN_IP" --main_process_port "$MAIN_PORT")
if grep -q "^parallelism_config:" "$ACCEL_CONFIG"; then
    # Hybrid shard (fsdp2_hybrid.yaml): replicate across nodes, shard over the GPUs of one node.
    LAUNCH_ARGS+=(--parallelism_config_dp_replicate_size "$NUM_MACHINES" --parallelism_config_dp_shard_size "$GPUS_PER_NODE")
fi
echo "$NUM_MACHINES nodes x $GPUS_PER_NODE GPUs, rendezvous $MAIN_IP:$MAIN_PORT, $ACCEL_CONFIG, $ENTRY --config $RECIPE $*"

# SLURM_NODEID is each node's machine rank; it is read on the node, inside the srun task.
srun --kill-on-bad-exit=1 bash -c 'exec "$0" launch --machine_rank "$SLURM_NODEID" "$@"' \
    "$ACCELERATE" "${LAUNCH_ARGS[@]}" "$ENTRY" --config "$RECIPE" --resume_from_checkpoint latest "$@"
