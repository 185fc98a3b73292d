#!/bin/bash
# usage: run_fv.sh NAME STEPS full|lora   (env: PEER scratch folder; FV_REPO this repository; FV_VENV its venv;
# HOOK the timing hook folder: /work/shared/peer/hook (step times) or hook_phase (phases, PHASE_OUT))
NAME=$1; STEPS=$2; MODE=$3; P=${PEER:?set PEER to the scratch folder}
FV_REPO=${FV_REPO:-$P/fv}; FV_VENV=${FV_VENV:-$FV_REPO/.venv}; HOOK=${HOOK:-$P/hook}
rm -rf $P/runs/$NAME $P/logs/$NAME.steps.jsonl
EXTRA=""
[ "$MODE" = lora ] && EXTRA="--models.student.lora.enable true --models.student.lora.rank 16 --models.student.lora.alpha 16"
# The repository first on the path (a venv's editable install may point at another checkout).
export PYTHONPATH=$HOOK:$FV_REPO STEPTIMER_OUT=$P/logs/$NAME.steps.jsonl OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1
cd $FV_REPO && /usr/bin/time -v $FV_VENV/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
  train_finetune.py --config configs/bench_small.yaml \
  --models.student.init_from $P/model_small --training.data.data_path $P/fvdata \
  --max_train_steps $STEPS --training.optimizer.learning_rate 1e-4 --training.checkpoint.save_final true \
  --training.tracker.trackers '[tensorboard]' --output_dir $P/runs/$NAME $EXTRA
