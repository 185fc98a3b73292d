"""Video sparse attention (fv_accel.vsa) against dense attention: time and FLOPs of one attention
layer at Wan 2.1 1.3B's head shape (12 heads of 128), and of a whole training step of the small
benchmark model, dense vs VSA at sparsity 0.5 / 0.8 / 0.9, side by side in one run.

    python benchmarks/vsa.py                 # CPU: 480p x 13 frames (a 4 x 30 x 52 token grid)
    python benchmarks/vsa.py --quick         # CPU smoke test: a 4 x 8 x 16 grid, the tiny model
    python benchmarks/vsa.py --mode gpu      # CUDA, bf16: 480p x 81 frames (21 x 30 x 52 tokens)

Wan 2.1 1.3B at 480p x 81 frames attends over a 21 x 30 x 52 grid (32,760 tokens): dense attention
of one layer is 6.6 TFLOP forward, a minute on two CPU cores, so the CPU mode keeps the 30 x 52
spatial grid of 480p and 4 latent frames (13 video frames, 6,240 tokens); the GPU mode runs the
real shape.

Attention variants: `dense` = SDPA; VSA through each backend that runs on the device (CPU:
`gathered` forward and backward, `flex` forward only, torch having no FlexAttention backward on
CPU; CUDA: `flex` compiled, and `kernel` when fastvideo-kernel is importable). Every round times
each variant once, in an order rotated every round; a speed-up is dense time / variant time in the
same round, reported as the median (min-max) over rounds. FLOPs are analytic (2 per multiply-add):
dense 4 L^2 D per head; VSA as its kernel computes it, 64 slots per selected tile plus the tile
attention (fv_accel.vsa.attention_flops). A training step counts 3x the forward.

Training step: the bare loop of benchmarks/_common.py (noise, flow-matching loss, backward, AdamW)
on the small benchmark model (configs/bench_small.yaml: 4 blocks, width 512, 2 x 15 x 26 tokens)
with stock attention, and the same weights with `enable_vsa` (backend auto) at each sparsity.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fv_accel import vsa  # noqa: E402

SPARSITIES = (0.5, 0.8, 0.9)
HEADS, HEAD_DIM = 12, 128  # Wan 2.1 1.3B
GRIDS = {"quick": (4, 8, 16), "cpu": (4, 30, 52), "gpu": (21, 30, 52)}
STEP_RECIPES = {"quick": "tiny", "cpu": "small", "gpu": "small"}
# Latent frames of the training-step comparison: the recipe's (None), and a longer clip at the
# same resolution, where self-attention is a larger share of the step.
STEP_LATENT_T = {"quick": [None], "cpu": [None, 8], "gpu": [None, 21]}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--mode", choices=("cpu", "gpu", "quick"), default=None, help="default: gpu when CUDA is available, else cpu")
    p.add_argument("--quick", action="store_true", help="same as --mode quick")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds (default: quick 2, cpu 3, gpu 5)")
    p.add_argument("--step-rounds", type=int, default=None, help="rounds of the training-step comparison (default: quick 2, else 5)")
    p.add_argument("--grid", type=int, nargs=3, default=None, help="token grid T H W of the attention layer")
    p.add_argument("--sparsities", type=float, nargs="+", default=list(SPARSITIES))
    p.add_argument("--step-latent-t", type=int, nargs="+", default=None,
                   help="latent frames of the training-step runs (default: the recipe's, and 8 on CPU / 21 on GPU)")
    p.add_argument("--skip-step", action="store_true", help="only the attention layer")
    p.add_argument("--skip-attention", action="store_true", help="only the training step")
    p.add_argument("--out", type=Path, default=C.RESULTS_DIR)
    p.add_argument("--name", default=None, help="base name of the result files (default: vsa, vsa_quick, vsa_gpu)")
    args = p.parse_args(argv)
    if args.quick:
        args.mode = "quick"
    if args.mode is None:
        args.mode = "gpu" if torch.cuda.is_available() else "cpu"
    if args.mode == "gpu" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/vsa.py --mode gpu: no CUDA device visible to torch")
    args.rounds = args.rounds or {"quick": 2, "cpu": 3, "gpu": 5}[args.mode]
    args.step_rounds = args.step_rounds or (2 if args.mode == "quick" else 5)
    args.grid = tuple(args.grid) if args.grid else GRIDS[args.mode]
    args.step_latent_t = args.step_latent_t or STEP_LATENT_T[args.mode]
    args.name = args.name or {"quick": "vsa_quick", "cpu": "vsa", "gpu": "vsa_gpu"}[args.mode]
    return args


# --------------------------------------------------------------------------------------------
# one attention layer
# --------------------------------------------------------------------------------------------


def attention_variants(device: torch.device, sparsities) -> list[dict]:
    """(name, backend, sparsity, backward?) of every variant that runs on this device."""
    out = [dict(name="dense", backend="sdpa", sparsity=None, backward=True)]
    backends = [("gathered", True), ("flex", False)] if device.type != "cuda" else [("flex", True)]
    if device.type == "cuda" and vsa.kernel_available():
        backends.append(("kernel", True))
    for s in sparsities:
        for backend, backward in backends:
            out.append(dict(name=f"{backend} s={s}", backend=backend, sparsity=s, backward=backward))
    return out


def attention_call(variant: dict, grid, q, k, v, gate) -> torch.Tensor:
    if variant["backend"] == "sdpa":
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return vsa.video_sparse_attention(q, k, v, grid=grid, sparsity=variant["sparsity"], gate=gate, backend=variant["backend"])


def timed(fn: Callable[[], Any], repeats: int) -> float:
    C.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    C.synchronize()
    return (time.perf_counter() - start) / repeats


def measure_attention(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    grid = args.grid
    tokens = math.prod(grid)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, gate = (torch.randn(1, tokens, HEADS, HEAD_DIM, generator=g, device=device, dtype=dtype) for _ in range(4))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, gate)]
    grad_out = torch.randn_like(q)
    repeats = 5 if device.type == "cuda" else 1
    variants = attention_variants(device, args.sparsities)

    def forward(var):
        with torch.no_grad():
            attention_call(var, grid, q, k, v, gate)

    def forward_backward(var):
        for x in leaves:
            x.grad = None
        attention_call(var, grid, *leaves).backward(grad_out)

    runs = {"fwd": forward, "fwd+bwd": forward_backward}
    times = {phase: {var["name"]: [] for var in variants} for phase in runs}
    print(f"[attention] grid {grid} ({tokens} tokens), {HEADS} heads of {HEAD_DIM}, {dtype}, {device}: warm-up", flush=True)
    for var in variants:  # warm-up (FlexAttention compiles on CUDA at its first call)
        for phase, fn in runs.items():
            if phase == "fwd" or var["backward"]:
                fn(var)
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for var in order:
            for phase, fn in runs.items():
                if phase == "fwd" or var["backward"]:
                    times[phase][var["name"]].append(timed(lambda: fn(var), repeats))
        print(f"[attention] round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {times['fwd'][n][-1]:.3f}s" for n in times["fwd"]), flush=True)
    rows = []
    n_tiles = vsa.tile_layout(grid).num_tiles
    dense_flops = vsa.attention_flops(grid, HEADS, HEAD_DIM, None)
    for var in variants:
        flops = vsa.attention_flops(grid, HEADS, HEAD_DIM, var["sparsity"])
        row = dict(var, flops_fwd=flops, flop_ratio=dense_flops / flops)
        row["kept_tiles"] = None if var["sparsity"] is None else f"{vsa.topk_tiles(var['sparsity'], n_tiles)}/{n_tiles}"
        for phase in runs:
            vals = times[phase][var["name"]]
            if not vals:
                continue
            row[f"{phase}_s"] = C.summarize(vals)
            row[f"{phase}_speedup"] = C.summarize([d / x for d, x in zip(times[phase]["dense"], vals)])
        rows.append(row)
    return {"grid": list(grid), "tokens": tokens, "tiles": n_tiles, "heads": HEADS, "head_dim": HEAD_DIM,
            "dtype": str(dtype), "device": str(device), "rounds": args.rounds, "repeats_per_timing": repeats,
            "variants": rows, "times_s": times}


# --------------------------------------------------------------------------------------------
# a training step of the small model
# --------------------------------------------------------------------------------------------


def step_flops(transformer: torch.nn.Module, grid, text_tokens: int, sparsity: Optional[float]) -> float:
    """Analytic FLOPs of one training step (batch 1): fv_accel.telemetry's dense count, with the
    self-attention term replaced by VSA's and the gate projections added when `sparsity` is set."""
    from fv_accel.telemetry import train_step_flops, transformer_shape

    shape = transformer_shape(transformer)
    tokens = math.prod(grid)
    heads, head_dim = transformer.config.num_attention_heads, transformer.config.attention_head_dim
    dense = train_step_flops(shape, 1, tokens, text_tokens=text_tokens)
    if sparsity is None:
        return dense
    layers = shape["layers"]
    dense_self = 3.0 * layers * vsa.attention_flops(grid, heads, head_dim, None)
    sparse_self = 3.0 * layers * vsa.attention_flops(grid, heads, head_dim, sparsity)
    gates = 3.0 * layers * 2.0 * tokens * shape["width"] ** 2
    return dense - dense_self + sparse_self + gates


def measure_step(args: argparse.Namespace, device: torch.device, latent_t: Optional[int]) -> dict:
    from fv_accel.config import load_config

    size = C.bench_size(STEP_RECIPES[args.mode], num_latent_t=latent_t)
    cfg = load_config(size.recipe)
    mixed = "bf16" if device.type == "cuda" else "no"
    c, t, h, w = size.latent_shape
    g = torch.Generator().manual_seed(0)
    batch = {"vae_latent": torch.randn(1, c, t, h, w, generator=g),
             "text_embedding": torch.randn(1, *size.text_shape, generator=g)}
    loops = {"dense": C.BareLoop(cfg, batch, device, mixed)}
    for s in args.sparsities:
        loop = C.BareLoop(cfg, batch, device, mixed)  # the same seed: the same weights
        vsa.enable_vsa(loop.model, s)
        # The optimizer was built before the gates existed: give it them too.
        loop.optimizer.add_param_group({"params": [p for n, p in loop.model.named_parameters() if "to_gate_compress" in n]})
        loops[f"vsa s={s}"] = loop
    patch = tuple(cfg.models.student.transformer_config["patch_size"])
    grid = (t // patch[0], h // patch[1], w // patch[2])
    backend = vsa.resolve_backend("auto", torch.empty(1, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32))
    print(f"[step] {size.name} model, latent {c}x{t}x{h}x{w}, batch 1: token grid {grid}; VSA backend {backend}: warm-up", flush=True)
    for loop in loops.values():
        loop.steps(1)
    names = list(loops)
    times: dict[str, list[float]] = {n: [] for n in names}
    steps = 3 if device.type == "cuda" else 1
    for r in range(args.step_rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            times[n] += [s.wall for s in loops[n].steps(steps)]
        print(f"[step] round {r + 1}/{args.step_rounds}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in names), flush=True)
    model = loops["dense"].model
    dense_flops = step_flops(model, grid, size.text_shape[0], None)
    rows = []
    for n in names:
        s = None if n == "dense" else float(n.split("=")[1])
        flops = step_flops(model, grid, size.text_shape[0], s)
        per_round = [sum(times["dense"][i * steps:(i + 1) * steps]) / sum(times[n][i * steps:(i + 1) * steps])
                     for i in range(args.step_rounds)]
        rows.append(dict(name=n, sparsity=s, step_s=C.summarize(times[n]), speedup=C.summarize(per_round),
                         flops=flops, flop_ratio=dense_flops / flops))
    return {"size": size.name, "recipe": str(size.recipe.relative_to(C.REPO)), "latent_shape": list(size.latent_shape),
            "grid": list(grid), "tiles": vsa.tile_layout(grid).num_tiles, "vsa_backend": backend, "mixed_precision": mixed,
            "rounds": args.step_rounds, "steps_per_round": steps, "variants": rows, "times_s": times}


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def fmt_ratio(stats: Optional[dict]) -> str:
    return "-" if not stats else f"{stats['median']:.2f}x ({stats['min']:.2f}-{stats['max']:.2f})"


def fmt_time(stats: Optional[dict]) -> str:
    return "-" if not stats else f"{stats['median']:.3f}"


def attention_markdown(a: dict) -> list[str]:
    lines = [f"## One attention layer: {a['grid'][0]} x {a['grid'][1]} x {a['grid'][2]} tokens ({a['tokens']}, "
             f"{a['tiles']} tiles), {a['heads']} heads of {a['head_dim']}, batch 1, {a['dtype']} on {a['device']}", "",
             f"Seconds per call, median over {a['rounds']} rounds; speed-up = dense / variant in the same round, "
             "median (min-max); FLOPs analytic, forward.", ""]
    header = ["variant", "kept tiles", "GFLOP fwd", "FLOP ratio", "fwd s", "fwd speed-up", "fwd+bwd s", "fwd+bwd speed-up"]
    rows = [[v["name"], v["kept_tiles"] or "all", f"{v['flops_fwd'] / 1e9:.1f}", f"{v['flop_ratio']:.2f}x",
             fmt_time(v.get("fwd_s")), fmt_ratio(v.get("fwd_speedup")), fmt_time(v.get("fwd+bwd_s")),
             fmt_ratio(v.get("fwd+bwd_speedup"))] for v in a["variants"]]
    return lines + [C.markdown_table(header, rows), ""]


def step_markdown(s: dict) -> list[str]:
    padded = s["tiles"] * vsa.TILE_TOKENS
    lines = [f"## A training step: the {s['size']} benchmark model ({s['recipe']}), latent "
             f"{'x'.join(map(str, s['latent_shape']))} = {s['grid'][0]} x {s['grid'][1]} x {s['grid'][2]} tokens "
             f"({math.prod(s['grid'])} tokens in {s['tiles']} tiles = {padded} slots), batch 1, VSA backend "
             f"{s['vsa_backend']}, mixed precision {s['mixed_precision']}", "",
             f"Bare loop (noise, loss, backward, AdamW), {s['rounds']} rounds of {s['steps_per_round']} step(s) per "
             "variant; FLOPs analytic (telemetry's count, self-attention replaced by VSA's over 64 slots per tile, "
             "gate projections added).", ""]
    rows = [[v["name"], fmt_time(v["step_s"]), fmt_ratio(v["speedup"]), f"{v['flops'] / 1e9:.1f}",
             f"{v['flop_ratio']:.2f}x"] for v in s["variants"]]
    return lines + [C.markdown_table(["variant", "step s", "speed-up", "GFLOP", "FLOP ratio"], rows), ""]


def to_markdown(payload: dict) -> str:
    lines = [f"# Video sparse attention vs dense ({payload['mode']} mode)", "",
             f"Machine: {C.machine_line(payload['machine'])}.", f"Command: `{payload['command']}`", ""]
    if payload.get("attention"):
        lines += attention_markdown(payload["attention"])
    for step in payload.get("steps", []):
        lines += step_markdown(step)
    lines += [f"Finished {payload['finished']}."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device("cuda" if args.mode == "gpu" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    payload: dict[str, Any] = {"benchmark": "vsa", "mode": args.mode, "command": C.command_line("vsa.py", argv),
                               "machine": C.machine_info(), "kernel_available": vsa.kernel_available()}
    if not args.skip_attention:
        payload["attention"] = measure_attention(args, device, dtype)
    if not args.skip_step:
        payload["steps"] = [measure_step(args, device, t) for t in args.step_latent_t]
    payload["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    C.publish_results(args.out, args.name, payload, to_markdown(payload))
    return payload


if __name__ == "__main__":
    main()
