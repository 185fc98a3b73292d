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
# (accelerate_configs/fsdp2.yaml), GPUS_PER_NODE (8), MAIN_PORT (29500), PYTHON (python).
#
# Preemption at the time limit: SLURM sends SIGUSR1 to this script 10 minutes before it
# (--signal=B:USR1@600; raise it when one step plus one checkpoint save take longer). The script
# then sends SIGTERM to the training step (scancel --signal=TERM); each node's launcher,
# `python -m fv_accel.launch` (accelerate launch that relays SIGTERM to its training processes
# instead of ending the launch), waits while they finish the step, save a checkpoint and exit 0.
# The trainer names the checkpoint in $FV_ACCEL_STOPPED_FILE; then the script requeues the job
# (scontrol requeue) and exits 0. The run always passes --resume_from_checkpoint latest, so the
# requeued job continues from that checkpoint (a first run starts fresh). See
# docs/checkpoints-and-faults.md.
#SBATCH --job-name=fv_accel
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
set -euo pipefail

RECIPE=${1:?usage: sbatch accelerate_configs/slurm_multinode.sh RECIPE.yaml [ENTRY] [--section.key VALUE ...]}
ENTRY=${2:-train_finetune.py}
shift $(( $# >= 2 ? 2 : 1 ))
ACCEL_CONFIG=${ACCEL_CONFIG:-accelerate_configs/fsdp2.yaml}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAIN_PORT=${MAIN_PORT:-29500}
PYTHON=${PYTHON:-python}
NUM_MACHINES=${SLURM_NNODES:?run this under sbatch}
NUM_PROCESSES=$(( NUM_MACHINES * GPUS_PER_NODE ))
# Not `| head -n 1`: under pipefail, scontrol writing after head exits (SIGPIPE) would end the script.
NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
MAIN_IP=${NODES%%$'\n'*}

LAUNCH_ARGS=(--config_file "$ACCEL_CONFIG" --num_machines "$NUM_MACHINES" --num_processes "$NUM_PROCESSES"
             --main_process_ip "$MAIN_IP" --main_process_port "$MAIN_PORT")
if grep -q "^parallelism_config:" "$ACCEL_CONFIG"; then
    # Hybrid shard (fsdp2_hybrid.yaml): replicate across nodes, shard over the GPUs of one node.
    LAUNCH_ARGS+=(--parallelism_config_dp_replicate_size "$NUM_MACHINES" --parallelism_config_dp_shard_size "$GPUS_PER_NODE")
fi
echo "$NUM_MACHINES nodes x $GPUS_PER_NODE GPUs, rendezvous $MAIN_IP:$MAIN_PORT, $ACCEL_CONFIG, $ENTRY --config $RECIPE $*"

# Written by the trainer (rank 0) when a signal stopped the run with a checkpoint.
export FV_ACCEL_STOPPED_FILE=${FV_ACCEL_STOPPED_FILE:-${SLURM_SUBMIT_DIR:-$PWD}/.fv_accel_stopped_${SLURM_JOB_ID}}
rm -f "$FV_ACCEL_STOPPED_FILE"

STOP_SENT=0
stop_training() {
    STOP_SENT=1
    echo "time limit near (SIGUSR1): asking the training step to save a checkpoint and stop"
    scancel --signal=TERM "$SLURM_JOB_ID" || true  # the job's steps, not this script
}
trap stop_training USR1
# A preemption or `scancel` sends SIGTERM to this script and to the step's processes at once: keep
# waiting while the step saves its checkpoint (SLURM requeues a preempted job itself).
trap 'echo "SIGTERM: waiting for the training step to stop"' TERM

# SLURM_NODEID is each node's machine rank; it is read on the node, inside the srun task. srun runs
# in the background so that the trap runs as soon as the signal arrives (bash runs traps between
# commands, and `wait` returns early for them).
srun --kill-on-bad-exit=1 bash -c 'exec "$0" -m fv_accel.launch --machine_rank "$SLURM_NODEID" "$@"' \
    "$PYTHON" "${LAUNCH_ARGS[@]}" "$ENTRY" --config "$RECIPE" --resume_from_checkpoint latest "$@" &
STEP_PID=$!
while kill -0 "$STEP_PID" 2>/dev/null; do
    wait "$STEP_PID" || true  # returns early when the trap runs
done
RC=0
wait "$STEP_PID" || RC=$?  # the step's exit status (bash keeps it)

if [[ $RC -eq 0 && -s "$FV_ACCEL_STOPPED_FILE" ]]; then
    CHECKPOINT=$(cat "$FV_ACCEL_STOPPED_FILE")
    rm -f "$FV_ACCEL_STOPPED_FILE"
    if [[ $STOP_SENT -eq 1 ]]; then
        echo "stopped for the time limit with a checkpoint in $CHECKPOINT; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "stopped by a signal with a checkpoint in $CHECKPOINT; not requeued by this script"
    fi
elif [[ $STOP_SENT -eq 1 && $RC -eq 0 ]]; then
    echo "the run ended before it could stop for the time limit: not requeued"
fi
exit "$RC"
