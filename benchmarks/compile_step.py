"""Step time with and without `training.model.compile: blocks` (Inductor on the transformer's
repeated blocks), through the real Trainer, and the time the first compiled step spends compiling.

    python benchmarks/compile_step.py                        # small size, SFT, 2 warm-up + 4 steps
    python benchmarks/compile_step.py --sizes tiny --steps 3 --method dfsft

Per variant (eager, then compiled, each in a fresh run): the first step (for the compiled run,
Dynamo tracing + Inductor code generation + the step), `--warmup - 1` more unmeasured steps, then
`--steps` measured steps; wall and process CPU time of each. Compile time = the compiled run's
first step minus the eager run's first step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402


def run_variant(size, data_path: str, method: str, compile_mode: str, warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = C.bench_overrides(
            Path(tmp) / "out", data_path, method,
            **{"training.model.compile": compile_mode, "training.loop.max_train_steps": warmup + steps},
        )
        times = C.OursRunner(size.recipe, overrides).steps(warmup + steps)
        C.reset_accelerate_state()
    measured = times[warmup:]
    return {
        "first_step_wall_s": times[0].wall,
        "step_wall_s": C.summarize([t.wall for t in measured]),
        "step_cpu_s": C.summarize([t.cpu for t in measured]),
    }


def main(argv: Optional[list[str]] = None) -> int:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["small"], choices=sorted(C.SIZE_RECIPES))
    p.add_argument("--method", default="finetune", choices=["finetune", "dfsft"])
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps, the first included (>= 1)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, default=C.RESULTS_DIR)
    p.add_argument("--work-dir", type=Path, default=C.WORK_DIR)
    args = p.parse_args(argv)
    args.warmup = max(1, args.warmup)
    info = C.machine_info()
    rows, payload = [], {"machine": info, "command": C.command_line("benchmarks/compile_step.py", argv or sys.argv[1:]), "sizes": {}}
    for name in args.sizes:
        size = C.bench_size(name)
        data_path, _ = C.prepare_dataset(args.work_dir, size, rows=max(8, args.warmup + args.steps))
        result = {mode: run_variant(size, data_path, args.method, mode, args.warmup, args.steps) for mode in ("none", "blocks")}
        eager, compiled = result["none"], result["blocks"]
        result["compile_s"] = compiled["first_step_wall_s"] - eager["first_step_wall_s"]
        result["compiled_over_eager_wall"] = compiled["step_wall_s"]["median"] / eager["step_wall_s"]["median"]
        result["compiled_over_eager_cpu"] = compiled["step_cpu_s"]["median"] / eager["step_cpu_s"]["median"]
        payload["sizes"][name] = result
        rows.append([
            size.describe(), args.method,
            f"{eager['step_wall_s']['median']:.3f}", f"{compiled['step_wall_s']['median']:.3f}",
            f"{result['compiled_over_eager_wall']:.3f}", f"{result['compiled_over_eager_cpu']:.3f}", f"{result['compile_s']:.1f}",
        ])
    header = ["size", "method", "eager s/step", "compiled s/step", "ratio (wall)", "ratio (CPU)", "compile s"]
    markdown = f"{C.machine_line(info)}\n\n{C.markdown_table(header, rows)}\n"
    print(markdown)
    C.write_results(args.out, "compile_step", payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
