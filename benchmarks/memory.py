"""Peak memory of a training step, and how memory and step time grow with latent frames and batch.

    python benchmarks/memory.py                  # small size: full vs LoRA x gradient checkpointing,
                                                 # T = 4, 8, 16, 32 and batch 1, 2, 4
    python benchmarks/memory.py --quick          # tiny size, one configuration (smoke test)
    python benchmarks/memory.py --size wan_1_3b --groups modes --modes full-ckpt lora-ckpt --methods sft dfsft

Every configuration runs in a fresh subprocess through build_from_config and the real Trainer. Before
the first step the optimizer's state is materialised (a zero-gradient AdamW step, which leaves the
weights as they are up to weight decay), so that "setup" memory holds the model, the optimizer and
its state; then one measured step runs.

- CPU: resident set size. The peak is the kernel's high-water mark (VmHWM), reset to the current
  RSS just before the measured step (/proc/self/clear_refs); glibc is told to hand large blocks back
  to the kernel at once (MALLOC_MMAP_THRESHOLD_), so that RSS follows the live tensors.
- GPU: torch.cuda.memory_allocated / max_memory_allocated, the peak reset before the step.

Reported per configuration: setup memory; the peak through forward and backward (read by an
optimizer pre-step hook) and over the whole step; activation memory = forward/backward peak minus
setup (it includes the gradients, given separately as trainable parameters x 4 bytes).
Target: gradient checkpointing cuts the small size's activation memory by at least 40%.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import torch  # noqa: E402

MODES = {
    "full": {"lora": False, "ckpt": False},
    "full-ckpt": {"lora": False, "ckpt": True},
    "lora": {"lora": True, "ckpt": False},
    "lora-ckpt": {"lora": True, "ckpt": True},
    # The speed and memory options (docs/performance.md): repeated-block compilation, and the
    # frozen base stored in fp8 under LoRA.
    "full-compile": {"lora": False, "ckpt": False, "overrides": {"training.model.compile": "blocks"}},
    "full-ckpt-compile": {"lora": False, "ckpt": True, "overrides": {"training.model.compile": "blocks"}},
    "lora-ckpt-fp8": {"lora": True, "ckpt": True, "overrides": {"models.student.storage_dtype": "float8_e4m3fn"}},
}
# Methods: SFT, DFSFT (bidirectional) and causal DFSFT (block-causal attention; backend auto:
# FlexAttention on CUDA, forward and backward; the chunked path on CPU, where flex has no backward).
METHODS = {
    "sft": ("finetune", {}),
    "dfsft": ("dfsft", {}),
    "dfsft_causal": ("dfsft", {"models.student.causal": True, "models.student.causal_attention_backend": "auto"}),
}
CKPT_TARGET = 0.40  # at least a 40% cut of activation memory at the small size
GIB = 2**30


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--size", default="small", choices=sorted(C.SIZE_RECIPES))
    p.add_argument("--groups", nargs="+", default=["modes", "frames", "batch"], choices=["modes", "frames", "batch"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--methods", nargs="+", default=["sft"], choices=list(METHODS), help="methods of the modes group")
    p.add_argument("--configs", nargs="+", metavar="METHOD:MODE", help="the modes group as a list, e.g. sft:full-ckpt dfsft:full-ckpt sft:lora-ckpt (instead of --methods x --modes)")
    p.add_argument("--frames", nargs="+", type=int, default=[4, 8, 16, 32], help="latent frames T of the frames group")
    p.add_argument("--frames-modes", nargs="+", default=["full", "full-ckpt"], choices=list(MODES))
    p.add_argument("--frames-methods", nargs="+", default=["sft"], choices=list(METHODS), help="methods of the frames group")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4], help="batch sizes of the batch group")
    p.add_argument("--steps", type=int, default=2, help="steps per configuration: memory is read on the first, time is the median of the others")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    p.add_argument("--quick", action="store_true", help="tiny size, full mode only, one step (smoke test)")
    p.add_argument("--out", type=Path, default=C.RESULTS_DIR)
    p.add_argument("--name", default="memory", help="base name of the result files")
    p.add_argument("--work-dir", type=Path, default=C.WORK_DIR)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # JSON spec: run one configuration here
    p.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.groups, args.modes, args.methods, args.steps = "tiny", ["modes"], ["full"], ["sft"], 1
    return args


# ---------------------------------------------------------------------------------------------
# one configuration, in its own process
# ---------------------------------------------------------------------------------------------
class MemoryProbe(C.TrainerCallback):
    """Materialises the optimizer state, records setup memory, and reads the peaks of the first step."""

    def __init__(self) -> None:
        self.on_cuda = torch.cuda.is_available()
        self.setup_bytes: Optional[int] = None
        self.peak_fwd_bwd: Optional[int] = None
        self.peak_step: Optional[int] = None
        self.step_times: list[float] = []
        self._t = 0.0

    def current(self) -> int:
        if self.on_cuda:
            return torch.cuda.memory_allocated()
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss

    def reset_peak(self) -> None:
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        with open("/proc/self/clear_refs", "w") as fh:  # "5": reset the RSS high-water mark
            fh.write("5")

    def peak(self) -> int:
        if self.on_cuda:
            return torch.cuda.max_memory_allocated()
        return int(C.rss_high_water_kb()) * 1024

    def on_train_start(self, trainer: Any) -> None:
        if self.setup_bytes is not None:
            return
        optimizer = trainer.method.optimizer
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the torch one
        materialize_optimizer_state(inner)
        inner.register_step_pre_hook(self._before_optimizer_step)
        gc.collect()
        C.synchronize()
        self.setup_bytes = self.current()
        self.reset_peak()
        self._t = time.perf_counter()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.peak_fwd_bwd is None:
            C.synchronize()
            self.peak_fwd_bwd = self.peak()

    def on_step_end(self, trainer: Any, step: int, logs: dict) -> None:
        C.synchronize()
        now = time.perf_counter()
        self.step_times.append(now - self._t)
        self._t = now
        if self.peak_step is None:
            self.peak_step = self.peak()


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """A zero-gradient step: AdamW allocates its moments; the update is zero (weight decay aside)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_worker(spec: dict, result_file: Path) -> None:
    size = C.bench_size(spec["size"], num_latent_t=spec["T"], batch_size=spec["batch"])
    data_path = spec["data_path"]
    if spec.get("in_memory_data"):
        C.prepare_dataset(Path(spec["work_dir"]), size, spec["rows"])  # installs the in-memory stand-in
    # The recipe's num_latent_t / num_frames would leave out rows of another length (they filter the data).
    extra: dict[str, Any] = {
        "training.data.train_batch_size": spec["batch"],
        "training.data.num_latent_t": spec["T"],
        "training.data.num_frames": None,
    }
    # Set both ways: a size's recipe may turn checkpointing or LoRA on itself.
    extra["training.model.enable_gradient_checkpointing_type"] = "full" if spec["ckpt"] else None
    extra["models.student.lora.enable"] = bool(spec["lora"])
    method_name, method_overrides = METHODS[spec["method"]]
    extra.update(method_overrides)
    extra.update(spec.get("overrides") or {})
    if method_name == "dfsft" and spec.get("chunk_size"):
        extra["method.chunk_size"] = spec["chunk_size"]
    overrides = C.bench_overrides(Path(spec["out_dir"]), data_path, method_name, **extra)
    probe = MemoryProbe()
    runner = C.OursRunner(size.recipe, overrides, extra_callbacks=[probe])
    model = runner.accelerator.unwrap_model(runner.run.method.student.transformer)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    runner.steps(spec["steps"])
    times = probe.step_times
    result = {
        **{k: spec[k] for k in ("label", "group", "method", "lora", "ckpt", "T", "batch")},
        "tokens_per_step": spec["batch"] * size.tokens_per_sample,
        "params": total,
        "trainable_params": trainable,
        "grad_gb": trainable * 4 / GIB,
        "setup_gb": probe.setup_bytes / GIB,
        "peak_fwd_bwd_gb": probe.peak_fwd_bwd / GIB,
        "peak_step_gb": probe.peak_step / GIB,
        "activation_gb": (probe.peak_fwd_bwd - probe.setup_bytes) / GIB,
        "step_time_s": C.summarize(times[1:] if len(times) > 1 else times)["median"],
        "step_times_s": times,
        "overrides": spec.get("overrides") or {},
        "model_flops_per_step": C.model_flops_per_step(model, size),
        "memory_kind": "cuda allocated" if probe.on_cuda else "cpu rss",
    }
    if not probe.on_cuda:
        import resource

        result["process_max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    result_file.write_text(json.dumps(result) + "\n")


# ---------------------------------------------------------------------------------------------
# the plan, run config by config in subprocesses
# ---------------------------------------------------------------------------------------------
def config_spec(group: str, label: str, mode: str, method: str, T: int, batch: int) -> dict:
    """One configuration to measure: its place in the results, method, clip length, batch and the mode's settings."""
    return {"group": group, "label": label, "method": method, "T": T, "batch": batch, "mode": mode, **MODES[mode]}


def plan(args: argparse.Namespace) -> list[dict]:
    base = C.bench_size(args.size)
    t0, b0 = base.latent_shape[1], base.batch_size
    out: list[dict] = []

    def add(group: str, label: str, mode: str, method: str, T: int, batch: int) -> None:
        out.append(config_spec(group, label, mode, method, T, batch))

    if "modes" in args.groups:
        pairs = [(m, mode) for m in args.methods for mode in args.modes]
        if args.configs:
            pairs = [tuple(c.split(":", 1)) for c in args.configs]
            for method, mode in pairs:
                if method not in METHODS or mode not in MODES:
                    raise SystemExit(f"--configs {method}:{mode}: expected METHOD:MODE with METHOD {'|'.join(METHODS)} and MODE {'|'.join(MODES)}")
        for method, mode in pairs:
            add("modes", f"{method} {mode}", mode, method, t0, b0)
    if "frames" in args.groups:
        for method in args.frames_methods:
            for mode in args.frames_modes:
                for T in args.frames:
                    add("frames", f"{method} {mode} T={T}", mode, method, T, b0)
    if "batch" in args.groups:
        for batch in args.batches:
            add("batch", f"sft full batch={batch}", "full", "sft", t0, batch)
    return out


def run_config(spec: dict, args: argparse.Namespace, scratch: Path) -> dict:
    size = C.bench_size(args.size, num_latent_t=spec["T"], batch_size=spec["batch"])
    rows = max(4, 2 * spec["batch"])
    data_path, data_kind = C.prepare_dataset(args.work_dir, size, rows)
    chunk = None
    if METHODS[spec["method"]][0] == "dfsft":
        from fv_accel.config import load_config, parse_chunk_size

        # A chunk no longer than the clip (the tiny and small recipes' chunk fits their own T).
        chunk = min(parse_chunk_size(load_config(size.recipe).method.chunk_size), spec["T"])
    full = {
        **spec,
        "size": args.size,
        "steps": args.steps,
        "data_path": data_path,
        "in_memory_data": data_kind.startswith("in memory"),
        "work_dir": str(args.work_dir),
        "rows": rows,
        "chunk_size": chunk,
        "out_dir": str(scratch / f"run-{len(list(scratch.iterdir()))}"),
    }
    result_file = scratch / f"result-{len(list(scratch.iterdir()))}.json"
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # large blocks mmap'd: freed memory leaves RSS
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(full), "--result-file", str(result_file)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=str(C.REPO), capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {args.timeout:.0f}s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result_file.is_file():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        oom = any("out of memory" in line.lower() for line in tail) or proc.returncode in (-9, 137)
        return {**spec, "error": ("out of memory: " if oom else "") + f"exit {proc.returncode}: " + " | ".join(tail)}
    result = json.loads(result_file.read_text())
    result["subprocess_wall_s"] = wall
    result["data"] = data_kind
    return result


def measure(
    size: str,
    mode: str = "full",
    *,
    method: str = "sft",
    T: Optional[int] = None,
    batch: Optional[int] = None,
    work_dir: Path = C.WORK_DIR,
    timeout: float = 1800.0,
    extra: Optional[dict] = None,
) -> dict:
    """One configuration measured in a fresh subprocess (the benchmark's own path): the result
    dict of `run_worker`, or {"error": ...}. `extra`: more recipe overrides (e.g. mixed precision)."""
    base = C.bench_size(size)
    spec = config_spec("modes", f"{method} {mode}", mode, method, T or base.latent_shape[1], batch or base.batch_size)
    spec["overrides"] = {**(MODES[mode].get("overrides") or {}), **(extra or {})}
    args = argparse.Namespace(size=size, work_dir=Path(work_dir), steps=1, timeout=timeout)
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work_dir, prefix="memory-") as scratch:
        return run_config(spec, args, Path(scratch))


def gb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def to_markdown(payload: dict) -> str:
    lines = [
        f"# Memory ({payload['size']} size; {payload['memory_kind']})",
        "",
        f"Machine: {C.machine_line(payload['machine'])}.",
        f"Command: `{payload['command']}`",
        "",
        "GiB. setup = model + optimizer and its state; activation = forward/backward peak - setup (includes the "
        "gradients, column grads); step time of the configuration's steps after the first (one step: the first).",
        "",
    ]
    header = ["configuration", "T", "batch", "tokens", "trainable params", "setup", "peak fwd/bwd", "peak step",
              "activation", "grads", "s/step", "tokens/s", "MFU"]
    peak = payload.get("peak_flops")
    for group in ("modes", "frames", "batch"):
        rows = []
        for r in payload["results"]:
            if r["group"] != group:
                continue
            if "error" in r:
                rows.append([r["label"], r["T"], r["batch"], "-", "-", "-", "-", "-", r["error"][:60], "-", "-", "-", "-"])
                continue
            rows.append(
                [r["label"], r["T"], r["batch"], r["tokens_per_step"], f"{r['trainable_params'] / 1e6:.2f}M",
                 gb(r["setup_gb"]), gb(r["peak_fwd_bwd_gb"]), gb(r["peak_step_gb"]), gb(r["activation_gb"]),
                 gb(r["grad_gb"]), f"{r['step_time_s']:.2f}", f"{r['tokens_per_step'] / r['step_time_s']:.0f}",
                 f"{r['model_flops_per_step'] / r['step_time_s'] / peak:.1%}" if peak and r.get("model_flops_per_step") else "-"]
            )
        if rows:
            lines += [f"## {group}", "", C.markdown_table(header, rows), ""]
    base = C.bench_size(payload["size"])
    if payload.get("checkpointing_cut"):
        lines.append("Gradient checkpointing's cut of activation memory (peak - setup), and in brackets of the same "
                     "less the gradients:")
    for key, cut in payload.get("checkpointing_cut", {}).items():
        verdict = ""
        if payload["size"] == "small" and key.endswith(f"T={base.latent_shape[1]} batch={base.batch_size}"):
            verdict = ": met" if cut >= CKPT_TARGET else ": MISSED"
            verdict = f" (target >= {CKPT_TARGET:.0%}){verdict}"
        without = payload.get("checkpointing_cut_without_grads", {}).get(key)
        extra = f" ({without:.1%})" if without is not None else ""
        lines.append(f"- {key}: {cut:.1%}{extra}{verdict}")
    return "\n".join(lines)


def checkpointing_cuts(results: list[dict], *, without_grads: bool = False) -> dict:
    """1 - activation(ckpt) / activation(no ckpt), for every pair that differs only in checkpointing;
    `without_grads`: both activations less the gradients' size (an approximation: the peaks need
    not hold every gradient)."""
    by_key = {}
    for r in results:
        if "error" not in r:
            # Pairs differ only in checkpointing: the option modes (compile, fp8 storage) pair among themselves.
            extra = json.dumps(r.get("overrides") or {}, sort_keys=True)
            by_key[(r["method"], r["lora"], r["T"], r["batch"], extra, r["ckpt"])] = r
    out = {}
    for (method, lora, T, batch, extra, ckpt), r in by_key.items():
        other = by_key.get((method, lora, T, batch, extra, False))
        if not ckpt or other is None:
            continue
        on, off = r["activation_gb"], other["activation_gb"]
        if without_grads:
            on, off = on - r["grad_gb"], off - other["grad_gb"]
        if off > 0:
            out[f"{method} {'LoRA' if lora else 'full'} T={T} batch={batch}"] = 1.0 - on / off
    return out


def make_payload(args: argparse.Namespace, argv: list[str], machine: dict, results: list[dict]) -> dict:
    kinds = {r.get("memory_kind") for r in results if "memory_kind" in r}
    return {
        "benchmark": "memory",
        "command": C.command_line("memory.py", argv),
        "machine": machine,
        "size": args.size,
        "memory_kind": ", ".join(sorted(kinds)) or "none measured",
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "results": results,
        "peak_flops": C.peak_flops(),
        "checkpointing_cut": checkpointing_cuts(results),
        "checkpointing_cut_without_grads": checkpointing_cuts(results, without_grads=True),
        "target_checkpointing_cut": CKPT_TARGET,
    }


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        run_worker(json.loads(args.worker), args.result_file)
        return {}
    machine = C.machine_info()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(dir=args.work_dir, prefix="memory-") as scratch:
        for spec in plan(args):
            res = run_config(spec, args, Path(scratch))
            results.append(res)
            # Written after every configuration: a time limit leaves the ones already measured.
            partial = make_payload(args, argv, machine, results)
            C.write_results(args.out, args.name, partial, to_markdown(partial))
            if "error" in res:
                print(f"[memory] {spec['label']}: {res['error']}", flush=True)
            else:
                print(
                    f"[memory] {res['label']}: setup {res['setup_gb']:.3f} GiB, peak fwd/bwd {res['peak_fwd_bwd_gb']:.3f}, "
                    f"activation {res['activation_gb']:.3f}, {res['step_time_s']:.2f} s/step",
                    flush=True,
                )
    payload = make_payload(args, argv, machine, results)
    C.publish_results(args.out, args.name, payload, to_markdown(payload))
    return payload


if __name__ == "__main__":
    main()
