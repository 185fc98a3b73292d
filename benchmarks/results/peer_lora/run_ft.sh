#!/bin/bash
# usage: run_ft.sh NAME STEPS full|lora   (env: PEER scratch folder holding ft-venv, model_small, ft_dataset.json,
# scripts/ft_train.py; HOOK the timing hook folder as in run_fv.sh)
NAME=$1; STEPS=$2; MODE=$3; P=${PEER:?set PEER to the scratch folder}; HOOK=${HOOK:-$P/hook}
rm -rf $P/runs/$NAME $P/logs/$NAME.steps.jsonl
EXTRA="--training_type full-finetune"
[ "$MODE" = lora ] && EXTRA="--training_type lora --rank 16 --lora_alpha 16 --target_modules blocks.*(to_q|to_k|to_v|to_out.0)"
export WORLD_SIZE=1 PYTHONPATH=$HOOK STEPTIMER_OUT=$P/logs/$NAME.steps.jsonl FT_LOSSES_OUT=$P/logs/$NAME.losses.json OMP_NUM_THREADS=2 WANDB_MODE=disabled HF_HUB_OFFLINE=1
/usr/bin/time -v $P/ft-venv/bin/python $P/scripts/ft_train.py \
  --parallel_backend accelerate --model_name wan --pretrained_model_name_or_path $P/model_small \
  --text_encoder_dtype fp32 --transformer_dtype fp32 --vae_dtype fp32 \
  --dataset_config $P/ft_dataset.json --dataset_shuffle_buffer_size 1 \
  --enable_precomputation --precomputation_items 8 --precomputation_once --precomputation_dir $P/runs/$NAME/precomputed \
  --flow_shift 3.0 --flow_weighting_scheme none --seed 0 --batch_size 1 --train_steps $STEPS \
  --checkpointing_steps 100000 --optimizer adamw --lr 1e-4 --lr_scheduler constant --lr_warmup_steps 0 \
  --beta1 0.9 --beta2 0.999 --weight_decay 0.01 --epsilon 1e-8 --max_grad_norm 1.0 \
  --output_dir $P/runs/$NAME --report_to none $EXTRA
