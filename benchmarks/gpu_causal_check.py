"""Checks and figures for block-causal students, on one GPU (or on CPU where flex has no backward).

    python benchmarks/gpu_causal_check.py [--device cuda|cpu] [--sections equality,grid,mask,rollout]
        [--rollout-frames 21] [--rollout-height 16] [--rollout-steps 4] [--rollout-chunk 3] [--threads N]

Sections (each prints one JSON line; the exit status is 1 if a check fails):
- equality: the tiny causal student (configs/tiny_dfsft_causal.yaml, chunk 3) with the FlexAttention
  and the chunked path against the dense boolean-mask SDPA reference, forward and parameter
  gradients, in the sequence and teacher-forcing layouts. On CPU torch has no FlexAttention
  backward, so flex is checked forward only there and the chunked path carries the gradients.
- grid: a Wan-1.3B-sized attention (12 heads x 128, bf16) over 21 frames of 30x52 tokens (480x832),
  flex against chunked, forward and input gradients, with their times (GPU only: the dense
  reference would need a 1 GB mask and 50 GB of scores).
- mask: bytes of the cached FlexAttention BlockMask for 21 frames of 30x52 tokens, chunk 3 and 1.
- rollout: KV-cached autoregressive rollout against the uncached full-sequence causal sampler:
  max difference and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fv_accel.config import load_config  # noqa: E402
from fv_accel.models import WanStudent  # noqa: E402
from fv_accel.models.attention import CausalAttention, CausalSpec, TokenLayout, block_mask_nbytes  # noqa: E402
from fv_accel.models.base import TrainingBatch  # noqa: E402
from fv_accel.rollout import causal_reference_sampler, kv_cached_rollout  # noqa: E402

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "tiny_dfsft_causal.yaml"
FAILED = []


def report(section: str, ok: bool, **figures) -> None:
    if not ok:
        FAILED.append(section)
    print(json.dumps({"section": section, "ok": ok, **figures}), flush=True)


def tiny_student(device: torch.device, chunk: int = 3, **overrides) -> WanStudent:
    cfg = load_config(RECIPE, {"method.chunk_size": chunk, **overrides})
    torch.manual_seed(0)
    student = WanStudent(cfg)
    student.init_preprocessors(cfg.training)
    student.transformer.to(device)
    return student


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_equality(device: torch.device) -> None:
    student = tiny_student(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 6, 8, 8, generator=g).to(device)
    context = torch.randn(2, 16, 6, 8, 8, generator=g).to(device)
    t = (torch.rand(2, 6, generator=g) * 1000).to(device)
    tb = TrainingBatch(encoder_hidden_states=torch.randn(2, 16, 32, generator=g).to(device))
    weight = torch.randn(2, 16, 12, 8, 8, generator=g).to(device)
    attn = student.causal_attention
    flex_grads = device.type == "cuda"

    def run(backend: str, layout: str, grads: bool):
        attn.backend = backend
        student.transformer.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grads):
            if layout == "sequence":
                out = student.predict_noise(x, t, tb)
                w = weight[:, :, :6]
            else:
                out = torch.cat(student.predict_noise_teacher_forcing(context, torch.zeros_like(t), x, t, tb), dim=2)
                w = weight
            if grads:
                (out * w).sum().backward()
        gr = {n: p.grad.detach().clone() for n, p in student.transformer.named_parameters() if p.grad is not None}
        return out.detach(), gr

    tol = 1e-4 if device.type == "cuda" else 1e-5
    for layout in ("sequence", "teacher_forcing"):
        ref, ref_g = run("dense", layout, True)
        for backend in ("chunked", "flex"):
            with_grads = backend == "chunked" or flex_grads
            out, gr = run(backend, layout, with_grads)
            fwd = float((out - ref).abs().max())
            # Gradients relative to each parameter's largest reference gradient.
            grad = (
                max(float((gr[n] - ref_g[n]).abs().max() / ref_g[n].abs().max().clamp_min(1e-12)) for n in ref_g)
                if with_grads
                else None
            )
            ok = fwd < tol and (grad is None or (gr.keys() == ref_g.keys() and grad < tol))
            report(
                "equality", ok, layout=layout, backend=backend, device=str(device), max_abs_forward=fwd,
                max_rel_grad=grad, grads_checked=with_grads, tolerance=tol,
            )


def check_grid(device: torch.device) -> None:
    if device.type != "cuda":
        report("grid", True, skipped="needs CUDA")
        return
    frames, s, heads, dim = 21, 30 * 52, 12, 128
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, heads, frames * s, dim, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    layout = TokenLayout("sequence", frames, s)
    results = {}
    for backend in ("chunked", "flex", "flex"):  # flex twice: the first call compiles
        attn = CausalAttention(CausalSpec(3), backend)
        for tensor in (q, k, v):
            tensor.grad = None
        _sync(device)
        start = time.perf_counter()
        out = attn.attend(q, k, v, layout, 0)
        out.float().square().mean().backward()
        _sync(device)
        results[backend] = (out.detach().float(), [t.grad.float() for t in (q, k, v)], time.perf_counter() - start)
    (oc, gc, tc), (of, gf, tf) = results["chunked"], results["flex"]
    fwd = float((oc - of).abs().max())
    grad = max(float((a - b).abs().max() / (a.abs().max() + 1e-12)) for a, b in zip(gc, gf))
    report(
        "grid", fwd < 2e-2 and grad < 2e-2, tokens=frames * s, max_abs_forward=fwd, max_rel_grad=grad,
        chunked_fwd_bwd_s=round(tc, 4), flex_fwd_bwd_s=round(tf, 4),
    )


def check_mask(device: torch.device) -> None:
    for chunk in (3, 1):
        attn = CausalAttention(CausalSpec(chunk), "flex")
        start = time.perf_counter()
        mask = attn.block_mask("sequence", 21, 30 * 52, device)
        built = time.perf_counter() - start
        nbytes = block_mask_nbytes(mask)
        dense = (21 * 30 * 52) ** 2
        report(
            "mask", nbytes < 10 * 2**20 and attn.block_mask("sequence", 21, 30 * 52, device) is mask,
            chunk=chunk, block_mask_bytes=nbytes, block_mask_mb=round(nbytes / 2**20, 3),
            dense_bool_mask_mb=round(dense / 2**20, 1), build_s=round(built, 4),
        )


def check_rollout(device: torch.device, frames: int, height: int, steps: int, chunk: int) -> None:
    student = tiny_student(device, chunk=chunk)
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(1, 16, frames, height, height, generator=g).to(device)
    text = torch.randn(1, 16, 32, generator=g).to(device)
    kwargs = dict(num_steps=steps, shift=3.0, guidance_scale=5.0, negative_text=torch.zeros_like(text))
    kv_cached_rollout(student, noise, text, **kwargs)  # warm-up
    _sync(device)
    cpu_start = time.process_time()
    cached = kv_cached_rollout(student, noise, text, **kwargs)
    _sync(device)
    cpu_cached = time.process_time() - cpu_start
    cpu_start = time.process_time()
    reference = causal_reference_sampler(student, noise, text, **kwargs)
    _sync(device)
    cpu_reference = time.process_time() - cpu_start
    diff = float((cached.latents - reference.latents).abs().max())
    report(
        "rollout", diff < 1e-4, device=str(device), latent_grid=[frames, height, height], chunk=chunk, steps=steps,
        guidance=5.0, max_abs_diff=diff, cached_s=round(cached.seconds, 3), uncached_s=round(reference.seconds, 3),
        speedup=round(reference.seconds / cached.seconds, 2),
        # Process CPU time is steadier than wall time on a shared machine.
        cached_cpu_s=round(cpu_cached, 3), uncached_cpu_s=round(cpu_reference, 3),
        cpu_time_speedup=round(cpu_reference / cpu_cached, 2), cached_frames=cached.forward_frames,
        uncached_frames=reference.forward_frames,
    )


def main() -> int:
    from fv_accel.process import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sections", default="equality,grid,mask,rollout")
    parser.add_argument("--rollout-frames", type=int, default=21)
    parser.add_argument("--rollout-height", type=int, default=16, help="latent height = width")
    parser.add_argument("--rollout-steps", type=int, default=4)
    parser.add_argument("--rollout-chunk", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    sections = args.sections.split(",")
    if "equality" in sections:
        check_equality(device)
    if "grid" in sections:
        check_grid(device)
    if "mask" in sections:
        check_mask(device)
    if "rollout" in sections:
        check_rollout(device, args.rollout_frames, args.rollout_height, args.rollout_steps, args.rollout_chunk)
    if FAILED:
        print(f"FAILED: {', '.join(FAILED)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
