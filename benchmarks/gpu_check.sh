#!/usr/bin/env bash
# One-GPU check of the scale-out engines: FSDP2 and DeepSpeed ZeRO-2, both methods, on a small
# random-init Wan at the 1.3B width (configs/gpu_check_small.yaml: 4 blocks of width 1536, 12 heads,
# FFN 8960; random latents of an 81-frame 480x832 clip = 32,760 tokens), bf16 compute over fp32
# master weights. Prints step time, peak memory and loss per run, and checks that a run resumed
# from its step-4 checkpoint (FSDP2: torch.distributed.checkpoint shards; ZeRO-2: DeepSpeed's
# engine checkpoint) ends where the uninterrupted run ended.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # from anywhere; default outputs/gpu_check
#
# Runs (8 steps each, one process, `accelerate launch --num_processes 1`):
#   fsdp2_finetune            accelerate_configs/fsdp2.yaml, SFT, full fine-tune, checkpoint at step 4
#   fsdp2_finetune_resumed    resumes fsdp2_finetune's checkpoint-4 in a fresh run
#   fsdp2_dfsft               DFSFT, full fine-tune, --fsdp_activation_checkpointing true
#   zero2_finetune            accelerate_configs/deepspeed_zero2.yaml, SFT, full fine-tune, checkpoint at step 4
#   zero2_finetune_resumed    resumes zero2_finetune's checkpoint-4
#   zero2_dfsft_lora          DFSFT, LoRA rank 32
# The DeepSpeed runs are skipped (and said so) when `import deepspeed` fails. Nothing is installed
# or downloaded. Budget: under 8 minutes on one H200 (each run has a time limit; runs that would
# start after 6.5 minutes are skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-outputs/gpu_check}"
PY="${PYTHON:-python}"
RUN_TIMEOUT="${GPU_CHECK_RUN_TIMEOUT:-110}"
LAST_START_S="${GPU_CHECK_LAST_START_S:-390}"
RECIPE=configs/gpu_check_small.yaml
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
mkdir -p "$OUT"
start=$(date +%s)

echo "== preflight"
"$PY" - <<'EOF' || exit 1
import importlib, sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA device visible to torch")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
for name in ("accelerate", "diffusers", "peft", "datasets", "deepspeed"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}")
    except Exception as err:  # deepspeed may fail on import for reasons other than absence
        print(f"{name}: unavailable ({type(err).__name__}: {err})")
EOF
if "$PY" -c "import deepspeed" >/dev/null 2>&1; then HAVE_DS=1; else HAVE_DS=0; fi

echo "== data: random latents and text embeddings in FastVideo's schema ($OUT/data)"
"$PY" - "$OUT/data" "$RECIPE" <<'EOF' || exit 1
import sys
from pathlib import Path
import torch
from fv_accel.config import load_config
from fv_accel.data.loader import TEXT_MAX_LENGTH
from fv_accel.data.schema import make_row, write_dataset_info, write_rows

folder, recipe = Path(sys.argv[1]), sys.argv[2]
cfg = load_config(recipe)
d, tc = cfg.training.data, cfg.models.student.transformer_config
shape = (tc["in_channels"], d.num_latent_t, d.num_height // 8, d.num_width // 8)
if not (folder / "data-00000.parquet").is_file():
    g = torch.Generator().manual_seed(0)
    rows = [
        make_row(
            sample_id=f"gpu-check-{i}",
            latent=torch.randn(shape, generator=g),
            text_embedding=torch.randn(TEXT_MAX_LENGTH, tc["text_dim"], generator=g),
            caption=f"random clip {i}",
            width=d.num_width, height=d.num_height, num_frames=d.num_frames, fps=16.0,
        )
        for i in range(cfg.training.loop.max_train_steps)  # one epoch = one run at batch 1
    ]
    write_rows(rows, folder / "data-00000.parquet")
    # Random latents are drawn normalised: statistics 0 and 1.
    write_dataset_info(folder, model=None, latent_stats=([0.0] * shape[0], [1.0] * shape[0]))
print(f"{cfg.training.loop.max_train_steps} clips, latent {shape}")
EOF

report() {  # NAME EXIT_CODE
    "$PY" - "$OUT" "$1" "$2" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, name, rc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
path = out / name / "logs" / "metrics.jsonl"
logs = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
logs = [r for r in logs if "loss" in r]
if not logs:
    print(f"{name}: FAILED (exit {rc}), no steps logged; see {out / (name + '.log')}")
    sys.exit(0)
timed = [r["step_time"] for r in logs if r["step"] > min(r["step"] for r in logs) + 1] or [r["step_time"] for r in logs]
peak = max(r.get("peak_mem_gb", float("nan")) for r in logs)
final = [p.name for p in (out / name).glob("transformer/*.safetensors")] + [p.name for p in (out / name).glob("pytorch_lora_weights*.safetensors")]
print(
    f"{name}: exit {rc} | steps {logs[0]['step']}-{logs[-1]['step']} | step time {statistics.median(timed):.3f} s "
    f"(median of {len(timed)}) | peak memory {peak:.2f} GiB | loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f} "
    f"| final files: {', '.join(final) or 'none'}"
)
EOF
}

compare_resume() {  # UNINTERRUPTED RESUMED
    "$PY" - "$OUT" "$1" "$2" <<'EOF'
import json, sys
from pathlib import Path
from safetensors.torch import load_file
out, a, b = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def losses(name):
    path = out / name / "logs" / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r} if path.is_file() else {}
la, lb = losses(a), losses(b)
common = sorted(set(la) & set(lb))
if not common:
    print(f"resume check {b}: no common steps logged")
    sys.exit(0)
loss_diff = max(abs(la[s] - lb[s]) for s in common)
wa, wb = (sorted((out / n / "transformer").glob("*.safetensors")) for n in (a, b))
if wa and wb and len(wa) == len(wb):
    diff = 0.0
    for fa, fb in zip(wa, wb):
        ta, tb = load_file(str(fa)), load_file(str(fb))
        diff = max([diff] + [(ta[k].float() - tb[k].float()).abs().max().item() for k in ta])
    weights = f"final weights max |diff| {diff:.3g}"
else:
    weights = "final weights: missing"
print(f"resume check {b} vs {a}: steps {common[0]}-{common[-1]}, loss max |diff| {loss_diff:.3g}; {weights}")
EOF
}

run() {  # NAME CONFIG ENTRY [RECIPE ARGS...]; launch options in LAUNCH_ARGS
    local name=$1 config=$2 entry=$3
    shift 3
    if (( $(date +%s) - start > LAST_START_S )); then
        echo "$name: skipped (time budget)"
        return
    fi
    rm -rf "${OUT:?}/$name"
    echo "== $name ($config ${LAUNCH_ARGS:-}, $entry $*)"
    timeout "$RUN_TIMEOUT" "$PY" -m accelerate.commands.launch --config_file "accelerate_configs/$config" \
        --num_processes 1 --num_machines 1 --main_process_port 0 --mixed_precision bf16 ${LAUNCH_ARGS:-} \
        "$entry" --config "$RECIPE" --output_dir "$OUT/$name" --training.data.data_path "$OUT/data" "$@" \
        > "$OUT/$name.log" 2>&1
    local rc=$?
    report "$name" "$rc"
    if (( rc != 0 )); then grep -E "Error|error:" "$OUT/$name.log" | tail -3; fi
}

run fsdp2_finetune fsdp2.yaml train_finetune.py
run fsdp2_finetune_resumed fsdp2.yaml train_finetune.py \
    --resume_from_checkpoint "$OUT/fsdp2_finetune/checkpoint-4" --training.checkpoint.training_state_checkpointing_steps 0
compare_resume fsdp2_finetune fsdp2_finetune_resumed
LAUNCH_ARGS="--fsdp_activation_checkpointing true" run fsdp2_dfsft fsdp2.yaml train_dfsft.py --method.name dfsft \
    --training.checkpoint.training_state_checkpointing_steps 0
if (( HAVE_DS )); then
    run zero2_finetune deepspeed_zero2.yaml train_finetune.py
    run zero2_finetune_resumed deepspeed_zero2.yaml train_finetune.py \
        --resume_from_checkpoint "$OUT/zero2_finetune/checkpoint-4" --training.checkpoint.training_state_checkpointing_steps 0
    compare_resume zero2_finetune zero2_finetune_resumed
    run zero2_dfsft_lora deepspeed_zero2.yaml train_dfsft.py --method.name dfsft --models.student.lora.enable true \
        --models.student.lora.rank 32 --models.student.lora.alpha 32 \
        --training.optimizer.learning_rate 1e-4 --training.checkpoint.training_state_checkpointing_steps 0
else
    echo "== DeepSpeed runs skipped: deepspeed is not importable here"
fi
echo "== done in $(( $(date +%s) - start )) s; logs and outputs in $OUT"
