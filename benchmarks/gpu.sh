#!/usr/bin/env bash
# GPU benchmark for one H200 (any single CUDA GPU works; MFU needs a known peak, see
# fv_accel/telemetry.py), in under 10 minutes (each phase has its own time limit and writes its
# results as it goes). Random-init Wans on random latents of an 81-frame 480x832 clip
# (16 x 21 x 60 x 104 latent = 32,760 tokens), bf16 compute, PyTorch SDPA attention (flash kernels
# on Hopper):
#   - the Wan-1.3B architecture (configs/gpu_bench_1_3b.yaml: 30 blocks, width 1536, 12 heads,
#     FFN 8960, text width 4096), fp32 master weights;
#   - the Wan-14B architecture (configs/gpu_bench_14b.yaml: 40 blocks, width 5120, 40 heads, FFN
#     13824), LoRA rank 16 over a frozen bf16 base, and over the same base stored in fp8.
#
#   bash benchmarks/gpu.sh [OUT_DIR]          # from the repository root; default benchmarks/results/gpu
#
# Needs torch (CUDA), diffusers, accelerate and peft; nothing is installed and nothing is
# downloaded. When the `datasets` package is missing, the benchmarks feed our loader from memory
# instead of Parquet (recorded in the results). Phases:
#   1. step_overhead.py (1.3B, checkpointing on): bare PyTorch loop vs our SFT and DFSFT through the
#      Trainer, and the bare LoRA loop vs our LoRA SFT, interleaved; step time, tokens/s, MFU,
#      ratios ours / bare; AdamW for-loop / foreach / fused.
#   2. memory.py (1.3B): peak memory, step time and MFU of SFT without and with gradient
#      checkpointing, causal DFSFT (block-causal FlexAttention, forward and backward) and SFT with
#      repeated-block compilation (training.model.compile: blocks), each in a fresh process.
#   3. memory.py (14B): LoRA over a bf16 base and over an fp8 base (models.student.storage_dtype).
# Results: OUT_DIR/step_overhead.{json,md}, memory_1_3b.{json,md}, memory_14b.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-benchmarks/results/gpu}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
# For checking this script's plumbing on a CPU machine: BENCH_SIZE=tiny BENCH_SIZE_LORA=tiny BENCH_ALLOW_CPU=1.
SIZE="${BENCH_SIZE:-wan_1_3b}"
SIZE_LORA="${BENCH_SIZE_LORA:-wan_14b}"
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

echo "== 1/3 step overhead: bare vs SFT vs DFSFT, bare LoRA vs LoRA SFT ($SIZE)"
timeout -k 15 170 "$PY" benchmarks/step_overhead.py --sizes "$SIZE" --rounds 2 --steps 2 --warmup 1 \
    --time-budget 90 --out "$OUT_DIR" --work-dir "$WORK_DIR" || echo "step_overhead.py failed or timed out (exit $?)"

echo "== 2/3 memory and MFU: checkpointing off/on, causal DFSFT (flex), compile ($SIZE)"
timeout -k 15 230 "$PY" benchmarks/memory.py --size "$SIZE" --groups modes --name memory_1_3b \
    --configs sft:full-ckpt sft:full dfsft_causal:full-ckpt sft:full-ckpt-compile \
    --steps 3 --timeout 100 --out "$OUT_DIR" --work-dir "$WORK_DIR" \
    || echo "memory.py ($SIZE) failed or timed out (exit $?)"

echo "== 3/3 LoRA over a bf16 and an fp8 base ($SIZE_LORA)"
timeout -k 15 190 "$PY" benchmarks/memory.py --size "$SIZE_LORA" --groups modes --name memory_14b \
    --configs sft:lora-ckpt-fp8 sft:lora-ckpt --steps 2 --timeout 90 --out "$OUT_DIR" --work-dir "$WORK_DIR" \
    || echo "memory.py ($SIZE_LORA) failed or timed out (exit $?)"

echo "== done in $(( $(date +%s) - start )) s; results in $OUT_DIR"
ls -l "$OUT_DIR"
