#!/usr/bin/env bash
# GPU benchmark for one H200 (any single CUDA GPU works; MFU needs a known peak, see
# fv_accel/telemetry.py): a random-init Wan at the 1.3B architecture (configs/gpu_bench_1_3b.yaml:
# 30 blocks, width 1536, 12 heads, FFN 8960, text width 4096) on random latents of an 81-frame
# 480x832 clip (16 x 21 x 60 x 104 latent = 32,760 tokens), bf16 compute over fp32 master weights,
# PyTorch SDPA attention (flash kernels on Hopper), full gradient checkpointing.
#
#   bash benchmarks/gpu.sh [OUT_DIR]          # from the repository root; default benchmarks/results/gpu
#
# Needs torch (CUDA), diffusers and accelerate; nothing is installed and nothing is downloaded. When
# the `datasets` package is missing, the benchmark feeds our loader from memory instead of Parquet
# (recorded in the results). Budget: under 8 minutes (each phase has its own time limit).
#   1. step_overhead.py: bare PyTorch loop vs our SFT and DFSFT through the Trainer, interleaved;
#      step time, latent tokens/s, MFU, ratios ours / bare.
#   2. memory.py: peak memory of SFT and DFSFT (full fine-tuning) and SFT LoRA, each in a fresh process.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-benchmarks/results/gpu}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
# For checking this script's plumbing on a CPU machine: BENCH_SIZE=tiny BENCH_ALLOW_CPU=1.
SIZE="${BENCH_SIZE:-wan_1_3b}"
WORK_DIR="${BENCH_WORK_DIR:-${TMPDIR:-/tmp}/fv_accel_bench}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
mkdir -p "$OUT_DIR" "$WORK_DIR"
start=$(date +%s)

echo "== preflight"
"$PY" - <<'EOF'
import importlib, sys
import torch
import os
if not torch.cuda.is_available() and os.environ.get("BENCH_ALLOW_CPU") != "1":
    sys.exit("gpu.sh: no CUDA device visible to torch")
for name in ("diffusers", "accelerate", "datasets", "peft", "psutil", "yaml"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except ImportError:
        print(f"{name}: not installed" + ("" if name in ("datasets", "peft") else " (required)"))
if torch.cuda.is_available():
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT_DIR/nvidia_smi.csv" || true
fi

echo "== 1/2 step overhead: bare vs SFT vs DFSFT ($SIZE)"
timeout -k 15 270 "$PY" benchmarks/step_overhead.py --sizes "$SIZE" --rounds 4 --steps 2 --warmup 1 \
    --time-budget 150 --out "$OUT_DIR" --work-dir "$WORK_DIR" || echo "step_overhead.py failed or timed out (exit $?)"

echo "== 2/2 memory: SFT and DFSFT full fine-tuning, SFT LoRA (gradient checkpointing on)"
configs=(sft:full-ckpt dfsft:full-ckpt)
if "$PY" -c "import peft" 2>/dev/null; then configs+=(sft:lora-ckpt); fi
timeout -k 15 190 "$PY" benchmarks/memory.py --size "$SIZE" --groups modes --configs "${configs[@]}" \
    --steps 2 --timeout 90 --out "$OUT_DIR" --work-dir "$WORK_DIR" \
    || echo "memory.py failed or timed out (exit $?)"

echo "== done in $(( $(date +%s) - start )) s; results in $OUT_DIR"
ls -l "$OUT_DIR"
