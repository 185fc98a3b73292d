"""One-GPU check of video sparse attention (fv_accel.vsa): do the backends agree, and how fast are
they? Installs and downloads nothing.

    python benchmarks/vsa_gpu_check.py                 # writes under $OUT (default outputs/vsa_gpu_check)
    python benchmarks/vsa_gpu_check.py --device cpu    # a dry run of the same code at a toy size

1. Preflight: torch, CUDA, the GPU, and whether fastvideo-kernel imports (if not, why; the check
   then compares and times flex, gathered and the reference only).
2. Agreement, on a 8 x 30 x 52 grid (12,480 tokens; Wan 2.1 1.3B's 12 heads of 128, its 480p
   spatial grid), sparsity 0.5 / 0.8 / 0.9 with a random gate: every backend's output against the
   reference backend in float32 on the same inputs (bf16 inputs for the bf16 backends), as max
   and mean absolute error; flex and gathered in float32 too; the gradients of flex vs the
   reference on a smaller grid.
3. Timing: benchmarks/vsa.py --mode gpu (one layer at 21 x 30 x 52 tokens, dense SDPA vs VSA per
   backend, forward and forward+backward; a training step of the small benchmark model).

Results: vsa_gpu_check.json / .md (agreement) and vsa_gpu.json / .md (timing) under the output folder.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import torch  # noqa: E402

from fv_accel import vsa  # noqa: E402

HEADS, HEAD_DIM = 12, 128
SPARSITIES = (0.5, 0.8, 0.9)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "outputs/vsa_gpu_check"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--grid", type=int, nargs=3, default=None, help="agreement grid (default 8 30 52; cpu: 4 8 12)")
    p.add_argument("--grad-grid", type=int, nargs=3, default=None, help="gradient grid (default 4 16 28; cpu: 4 4 8)")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.grid = tuple(args.grid or ((4, 8, 12) if cpu else (8, 30, 52)))
    args.grad_grid = tuple(args.grad_grid or ((4, 4, 8) if cpu else (4, 16, 28)))
    return args


def preflight(device: torch.device) -> dict:
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("vsa_gpu_check: no CUDA device visible to torch")
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    capability=list(torch.cuda.get_device_capability(0)))
    try:
        import fastvideo_kernel

        info["fastvideo_kernel"] = getattr(fastvideo_kernel, "__version__", "imported")
    except Exception as err:  # absent, or present without its compiled parts
        info["fastvideo_kernel"] = None
        info["fastvideo_kernel_error"] = f"{type(err).__name__}: {err}"
    info["kernel_backend_available"] = vsa.kernel_available()
    return info


def inputs(grid, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    tokens = math.prod(grid)
    return [torch.randn(1, tokens, HEADS, HEAD_DIM, generator=g, device=device, dtype=dtype) for _ in range(4)]


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (out.float() - ref.float()).abs()
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "ref_mean_abs": ref.float().abs().mean().item()}


def agreement(grid, device: torch.device) -> list[dict]:
    """Every backend vs the reference (float32, same inputs)."""
    rows = []
    half = [torch.bfloat16] if device.type == "cuda" else []
    backends = {torch.float32: ["gathered", "flex"], torch.bfloat16: ["gathered", "flex", "kernel"]}
    for s in SPARSITIES:
        base = inputs(grid, device, torch.float32)
        for dtype in [torch.float32] + half:
            q, k, v, gate = (x.to(dtype) for x in base)
            with torch.no_grad():
                ref = vsa.video_sparse_attention(*(x.float() for x in (q, k, v)), grid=grid, sparsity=s,
                                                 gate=gate.float(), backend="reference")
                # In bf16 the tile scores round differently: a near-tie can select another tile than
                # float32 does. The reference in the same dtype selects as the other backends do.
                ref_same = ref if dtype == torch.float32 else vsa.video_sparse_attention(
                    q, k, v, grid=grid, sparsity=s, gate=gate, backend="reference")
                for backend in backends[dtype]:
                    row = {"sparsity": s, "dtype": str(dtype), "backend": backend}
                    if backend == "kernel" and not vsa.kernel_available():
                        rows.append({**row, "skipped": "fastvideo-kernel is not importable"})
                        continue
                    try:
                        C.synchronize()
                        start = time.perf_counter()
                        out = vsa.video_sparse_attention(q, k, v, grid=grid, sparsity=s, gate=gate, backend=backend)
                        C.synchronize()
                        seconds = time.perf_counter() - start
                        same = {f"same_dtype_{key}": val for key, val in errors(out, ref_same).items()}
                        rows.append({**row, **errors(out, ref), **same, "first_call_s": seconds})
                    except Exception as err:
                        rows.append({**row, "error": f"{type(err).__name__}: {err}"})
                        traceback.print_exc()
            print(f"[agreement] sparsity {s} {dtype}: " + ", ".join(
                f"{r['backend']} {r.get('max_abs', r.get('skipped') or r.get('error'))}" for r in rows[-len(backends[dtype]):]), flush=True)
    return rows


def gradient_agreement(grid, device: torch.device) -> list[dict]:
    """Gradients of q, k, v and the gate: flex (where it has a backward) and gathered vs the reference."""
    rows = []
    names = ["gathered"] + (["flex"] if device.type == "cuda" else [])
    base = inputs(grid, device, torch.float32, seed=1)
    grads = {}
    for backend in ["reference"] + names:
        leaves = [x.clone().requires_grad_(True) for x in base]
        out = vsa.video_sparse_attention(*leaves[:3], grid=grid, sparsity=0.8, gate=leaves[3], backend=backend)
        out.backward(torch.ones_like(out))
        grads[backend] = [x.grad for x in leaves]
    for backend in names:
        for name, a, b in zip("qkvg", grads[backend], grads["reference"]):
            rows.append({"backend": backend, "input": name, **errors(a, b)})
    return rows


def to_markdown(payload: dict) -> str:
    pf = payload["preflight"]
    lines = ["# VSA GPU check: agreement of the backends", "",
             f"Machine: {C.machine_line(payload['machine'])}.",
             f"fastvideo-kernel: {pf.get('fastvideo_kernel') or 'not importable (' + pf.get('fastvideo_kernel_error', '') + ')'}.",
             f"Grid {payload['grid']} ({math.prod(payload['grid'])} tokens), {HEADS} heads of {HEAD_DIM}, random gate; "
             "errors against the reference backend on the same inputs, in float32 and in the backend's dtype.", ""]
    rows = [[r["sparsity"], r["dtype"], r["backend"],
             f"{r['max_abs']:.2e}" if "max_abs" in r else r.get("skipped") or r.get("error"),
             f"{r['mean_abs']:.2e}" if "mean_abs" in r else "-",
             f"{r['same_dtype_max_abs']:.2e}" if "same_dtype_max_abs" in r else "-",
             f"{r['same_dtype_mean_abs']:.2e}" if "same_dtype_mean_abs" in r else "-",
             f"{r['first_call_s']:.2f}" if "first_call_s" in r else "-"] for r in payload["agreement"]]
    header = ["sparsity", "dtype", "backend", "max abs err (fp32 ref)", "mean abs err (fp32 ref)",
              "max abs err (same-dtype ref)", "mean abs err (same-dtype ref)", "first call s"]
    lines += [C.markdown_table(header, rows), ""]
    lines += [f"Gradients (sparsity 0.8, grid {payload['grad_grid']}, float32) against the reference:", ""]
    rows = [[r["backend"], r["input"], f"{r['max_abs']:.2e}", f"{r['mean_abs']:.2e}"] for r in payload["gradients"]]
    lines += [C.markdown_table(["backend", "grad of", "max abs err", "mean abs err"], rows), ""]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"benchmark": "vsa_gpu_check", "machine": C.machine_info(), "preflight": preflight(device),
                               "grid": list(args.grid), "grad_grid": list(args.grad_grid)}
    print(f"[preflight] {payload['preflight']}", flush=True)
    payload["agreement"] = agreement(args.grid, device)
    payload["gradients"] = gradient_agreement(args.grad_grid, device)
    md = to_markdown(payload)
    C.write_results(args.out, "vsa_gpu_check", payload, md)
    print(md, flush=True)
    if not args.skip_timing:
        import importlib.util

        spec = importlib.util.spec_from_file_location("fv_bench_vsa", Path(__file__).with_name("vsa.py"))
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        mode = ["--mode", "gpu"] if device.type == "cuda" else ["--quick"]
        bench.main(mode + ["--out", str(args.out), "--rounds", "3", "--step-rounds", "3"])
    return payload


if __name__ == "__main__":
    main()
