"""Run telemetry: memory, estimated model FLOPs utilisation, and the end-of-run summary table.

MFU is an estimate: model FLOPs per step divided by the step time and the accelerator's peak
dense bf16 throughput. Model FLOPs of one sample with S tokens, N parameters, L blocks of width D
and a text of Lt tokens: forward `2 N S + 4 L S^2 D + 4 L S Lt D` (matrix products, self- and
cross-attention scores and mixing); a training step costs three forwards (backward = two).
Recomputation under gradient checkpointing is not counted (the usual convention), nor is the
saving of LoRA's frozen base weights (their weight gradients are never computed).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

# Peak dense bf16 tensor throughput (FLOP/s) by device-name fragment; first match wins.
PEAK_BF16_FLOPS = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 6000 Ada", 364e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def device_peak_flops(name: str) -> Optional[float]:
    for fragment, flops in PEAK_BF16_FLOPS:
        if fragment.lower() in name.lower():
            return flops
    return None


def transformer_shape(module: torch.nn.Module) -> dict[str, int]:
    """Parameters, blocks and width of a diffusers transformer (from its config where it has one)."""
    config = getattr(module, "config", None)
    get = (lambda k: getattr(config, k, None)) if config is not None else (lambda k: None)
    heads, head_dim = get("num_attention_heads"), get("attention_head_dim")
    return {
        "params": sum(p.numel() for p in module.parameters()),
        "layers": int(get("num_layers") or 0),
        "width": int(heads * head_dim) if heads and head_dim else 0,
    }


def train_step_flops(shape: dict[str, int], samples: int, tokens: int, text_tokens: int = 512) -> float:
    """Estimated model FLOPs of a training step over `samples` samples holding `tokens` tokens."""
    if samples <= 0:
        return 0.0
    per_sample = tokens / samples
    forward = (
        2.0 * shape["params"] * per_sample
        + 4.0 * shape["layers"] * per_sample**2 * shape["width"]
        + 4.0 * shape["layers"] * per_sample * text_tokens * shape["width"]
    )
    return 3.0 * samples * forward


def cpu_rss_bytes() -> int:
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)


class Telemetry:
    """Per-step system figures for the trainer's logs (this rank's; memory is per process)."""

    def __init__(self, accelerator: Any, transformer: torch.nn.Module, peak_tflops: Optional[float] = None):
        self.device = accelerator.device
        self.on_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        unwrapped = accelerator.unwrap_model(transformer)
        self.shape = transformer_shape(unwrapped)
        self.peak_flops: Optional[float] = None
        self.device_name = "cpu"
        if self.on_cuda:
            self.device_name = torch.cuda.get_device_name(self.device)
            self.peak_flops = peak_tflops * 1e12 if peak_tflops else device_peak_flops(self.device_name)
            if self.peak_flops is None and accelerator.is_main_process:
                logger.info(
                    "no peak FLOP/s known for %r: MFU is not logged (set training.tracker.peak_tflops)", self.device_name
                )
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak_rss = 0

    def step_metrics(self, *, step_time: float, samples: int, tokens: int) -> dict[str, float]:
        """`samples`/`tokens`: what this rank processed in the step."""
        rss = cpu_rss_bytes()
        self.peak_rss = max(self.peak_rss, rss)
        out = {"cpu_rss_gb": rss / 2**30}
        if self.on_cuda:
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            out["peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30
            if self.peak_flops and step_time > 0:
                out["mfu"] = train_step_flops(self.shape, samples, tokens) / (step_time * self.peak_flops)
        return out


def format_summary(summary: dict[str, Any]) -> str:
    """A two-column text table of the run summary (numbers rounded for reading)."""
    rows = []
    for key, value in summary.items():
        if isinstance(value, float):
            text = "nan" if math.isnan(value) else (f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}")
        elif isinstance(value, list):
            text = str(len(value))  # listed in logs/summary.json
        else:
            text = str(value)
        rows.append((key.replace("_", " "), text))
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * (vwidth + 2) + "+"
    body = [f"| {k.ljust(width)} | {v.rjust(vwidth)} |" for k, v in rows]
    return "\n".join([line, *body, line])
