"""The step-count curve of an any-step student: the AnyFlow student of the tiny chain (flow-map
pretraining, then on-policy) at 1, 2, 4, 8, 16 and 32 steps, against the teacher at the same step
counts and the 2-step DMD2 student, on the multimodal tiny world, side by side in one run.

    python benchmarks/anyflow_steps.py                     # the runs of docs/distillation.md's tiny chains
    python benchmarks/anyflow_steps.py --also outputs/tiny_anyflow_pretrain

Every sampler gets the same prompts (the world's captions) and the same seeded noises (`--seeds`
per caption). The teacher (outputs/tiny_dmd2_teacher) steps Euler at `--shift`; the AnyFlow student
steps its flow map, x_r = x_t - (t - r) / 1000 * u(x_t, t, r) with r the next timestep, on the
timesteps of the FlowMapEulerDiscreteScheduler its run folder holds (scheduler/, what diffusers'
AnyFlowPipeline steps); the DMD2 student (outputs/tiny_dmd2) its own 2 steps (benchmarks/distill.py).
Per sampler and step count: forwards per sample and the distances of benchmarks/distill.py to the
nearest clip of the sample's caption (RMS over the normalised latent; the shape's centre track in pixels).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import distill as D  # noqa: E402
import torch  # noqa: E402

ANYFLOW_RECIPE = "configs/tiny_anyflow_pretrain.yaml"


class CountingFlowMap:
    """An AnyFlow student as `u(x, t, r)` for one caption's conditioning, counting its calls."""

    def __init__(self, model: Any, cond: Any):
        self.model, self.cond, self.calls = model, cond, 0

    def __call__(self, x: torch.Tensor, t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.model.velocity_with_r(x, t, r, self.cond)


def load_anyflow(run_dir: Path) -> Any:
    """The AnyFlow student of a run folder (its `transformer/`, loaded as it is, not converted again)."""
    from fv_accel.config import load_config
    from fv_accel.models import build_student

    over = {"models.student.init_from": str(run_dir), "models.student.model_class": "auto",
            "models.student.anyflow_from_wan": False}
    model = build_student(load_config(ANYFLOW_RECIPE, over))
    model.transformer.eval()
    return model


def flow_map_timesteps(run_dir: Path, steps: int) -> list[float]:
    """The timesteps the run folder's scheduler (what AnyFlowPipeline loads) steps at `steps`, then 0."""
    from diffusers import FlowMapEulerDiscreteScheduler

    config = json.loads((run_dir / "scheduler" / "scheduler_config.json").read_text())
    scheduler = FlowMapEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(steps)
    return [float(t) for t in scheduler.timesteps[:steps]] + [0.0]


def flow_map_sample(u: Callable, noise: torch.Tensor, timesteps: list[float]) -> torch.Tensor:
    x = noise.clone()
    for t, r in zip(timesteps, timesteps[1:]):
        tt, rr = torch.full((x.shape[0],), t), torch.full((x.shape[0],), r)
        x = x - (t - r) / 1000.0 * u(x, tt, rr).float()
    return x


class FlowMapAdapter:
    """benchmarks/distill.measure hands its sampler a CountingVelocity; the flow map needs r too."""

    def __init__(self, model: Any, timesteps: list[float]):
        self.model, self.timesteps = model, timesteps

    def __call__(self, velocity: Any, noise: torch.Tensor) -> torch.Tensor:
        u = CountingFlowMap(self.model, velocity.cond)
        out = flow_map_sample(u, noise, self.timesteps)
        velocity.calls += u.calls
        return out


def run_samplers(args: argparse.Namespace, modes: Any, length: int) -> list[dict]:
    from fv_accel.sampling import dmd_denoising_timesteps, euler_sample, few_step_sample
    from fv_accel.schedulers import FlowMatchTable

    seeds = list(range(args.seeds))
    teacher = D.load_model(D.TEACHER_RECIPE, args.teacher)
    teacher_conds = D.caption_conditions(modes, teacher, length)
    students = [(D.shown(run), load_anyflow(run), run) for run in [args.anyflow, *args.also]]
    student_conds = {name: D.caption_conditions(modes, model, length) for name, model, _ in students}
    rows = []
    for steps in args.steps:
        sampler = lambda v, noise, n=steps: euler_sample(v, noise, n, shift=args.shift)  # noqa: E731
        rows.append({"steps": steps, "who": "teacher", **D.measure(f"teacher, Euler {steps} steps", sampler, teacher, modes, teacher_conds, seeds)})
        for name, model, run in students:
            timesteps = flow_map_timesteps(run, steps)
            row = D.measure(f"AnyFlow {name}, flow map {steps} steps", FlowMapAdapter(model, timesteps), model, modes,
                            student_conds[name], seeds)
            rows.append({"steps": steps, "who": name, "timesteps": timesteps, **row})
    if args.dmd2 is not None:
        table = FlowMatchTable(args.shift)
        dmd_steps, warp = D.student_schedule(args.dmd2, None, None)
        timesteps = dmd_denoising_timesteps(dmd_steps, table, warp)
        dmd2 = D.load_model(D.TEACHER_RECIPE, args.dmd2)

        def sampler(v: Callable, noise: torch.Tensor, t=timesteps) -> torch.Tensor:
            return few_step_sample(v, noise, t, table, [torch.Generator().manual_seed(10_000 + s) for s in seeds])

        row = D.measure(f"DMD2 {D.shown(args.dmd2)}, its {len(dmd_steps)} steps {dmd_steps}", sampler, dmd2, modes,
                        D.caption_conditions(modes, dmd2, length), seeds)
        rows.append({"steps": len(dmd_steps), "who": "dmd2", **row})
    return rows


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--teacher", type=Path, default=C.REPO / "outputs" / "tiny_dmd2_teacher")
    p.add_argument("--anyflow", type=Path, default=C.REPO / "outputs" / "tiny_anyflow", help="the AnyFlow student's run folder")
    p.add_argument("--also", type=Path, nargs="*", default=[], help="more AnyFlow run folders (e.g. the pretrained stage)")
    p.add_argument("--dmd2", type=Path, default=C.REPO / "outputs" / "tiny_dmd2", help="the DMD2 student's run folder ('' to leave out)")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--shift", type=float, default=3.0, help="the teacher's Euler sampling shift")
    p.add_argument("--seeds", type=int, default=8, help="seeds per caption")
    p.add_argument("--out", type=Path, default=C.RESULTS_DIR)
    p.add_argument("--name", default="anyflow_steps_tiny")
    args = p.parse_args(argv)
    if args.dmd2 is not None and str(args.dmd2) in ("", "."):
        args.dmd2 = None
    for run in [args.teacher, args.anyflow, *args.also, *([args.dmd2] if args.dmd2 else [])]:
        if not (run / "transformer" / "config.json").is_file():
            raise SystemExit(f"{run}: no transformer/config.json (train it first: see docs/distillation.md)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    from fv_accel.config import load_config
    from fv_accel.tiny import tiny_clip_modes

    args = parse_args(argv)
    info = C.machine_info()
    cfg = load_config(D.TEACHER_RECIPE)
    modes = tiny_clip_modes(cfg.training.data)
    rows = run_samplers(args, modes, cfg.training.data.text_max_length)
    reference = D.clips_reference(modes)
    table = [[r["sampler"], r["steps"], f"{r['forwards_per_sample']:g}", f"{r['latent_distance']:.3f}", f"{r['track_distance_px']:.2f}"]
             for r in rows]
    table.append([reference["sampler"], "-", "-", f"{reference['latent_distance']:.3f}", f"{reference['track_distance_px']:.2f}"])
    payload = {"machine": info, "command": C.command_line("anyflow_steps.py", argv if argv is not None else sys.argv[1:]),
               "seeds": args.seeds, "shift": args.shift, "rows": rows, "reference": reference,
               "captions": {c: modes.clips_of(c) for c in modes.captions}}
    markdown = (
        f"Machine: {C.machine_line(info)}.\n\nCommand: `{payload['command']}`\n\n"
        f"{len(payload['captions'])} captions x {args.seeds} seeds, the same noise for every sampler; distances to the nearest "
        "clip of the sample's caption, mean over captions and seeds.\n\n"
        f"{C.markdown_table(['sampler', 'steps', 'forwards/sample', 'latent distance (RMS)', 'track distance (px)'], table)}\n"
    )
    C.publish_results(args.out, args.name, payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
