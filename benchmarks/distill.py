"""Few-step sampling on the multimodal tiny world: the tiny DMD2 teacher at its own step count, at 4
and at 2 Euler steps, and DMD2 students at their few steps, on the same prompts and seeds.

    python benchmarks/distill.py                                  # the teacher (outputs/tiny_dmd2_teacher)
    python benchmarks/distill.py --student outputs/tiny_dmd2      # and a student (its steps from its checkpoint)
    python benchmarks/distill.py --student RUN --student_steps 1000 750 500 250 --student_warp

The prompts are the captions of the teacher recipe's multimodal tiny world (each caption has many
clips: one shape moving its way from other start positions at other speeds), each sampled from
`--seeds` seeded noises (the same noise for every sampler). The teacher samples with Euler
flow-matching steps at `--shift` (fv_accel.sampling.euler_sample); a student with the DMD sampler
(fv_accel.sampling.few_step_sample: predict the clean clip, re-noise it with seeded fresh noise to
the next timestep). Per sampler: transformer forwards per sample, wall time per sample (the seeds
of a caption run as one batch), and the mean over prompts and seeds of the distance to the NEAREST
clip of the sample's caption: RMS over the normalised latent, and the mean distance in pixels of the
shape's centre track, both clips and samples decoded by the tiny VAE (fv_accel/tiny/modes.py).

A few-step sampler that averages a caption's clips draws a blur far from all of them; a good one
lands near one. The reference row ("clips") is each clip scored against the other clips of its
caption: how far apart the modes are.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

TEACHER_RECIPE = "configs/tiny_dmd2_teacher.yaml"


class CountingVelocity:
    """A role's transformer as `predict_velocity(x, t)` for one caption's conditioning, counting
    its calls (each call runs the whole batch once)."""

    def __init__(self, model: Any, cond: Any):
        self.model, self.cond, self.calls = model, cond, 0

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        per_frame = self.model.capabilities.per_frame_timesteps
        return self.model.forward(x, t if per_frame else t[:, 0], self.cond)


def load_model(recipe: str, run_dir: Path) -> Any:
    """The model of a run folder (its `transformer/`), built as the recipe's student is."""
    from fv_accel.config import load_config
    from fv_accel.models import build_student

    if not (run_dir / "transformer" / "config.json").is_file():
        raise SystemExit(f"{run_dir}: no transformer/config.json (train it first: see docs/distillation.md)")
    cfg = load_config(recipe, {"models.student.init_from": str(run_dir), "models.student.model_class": "auto"})
    model = build_student(cfg)
    model.transformer.eval()
    return model


def student_schedule(run_dir: Path, steps: Optional[list[int]], warp: Optional[bool]) -> tuple[list[int], bool]:
    """A student's denoising steps and warp: from the command line, else from the recipe recorded
    in its last checkpoint's metadata.json (method.dmd_denoising_steps, method.warp_denoising_step)."""
    if steps:
        return list(steps), bool(warp)
    from fv_accel.checkpoint import latest_checkpoint, read_metadata, saved_recipe

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise SystemExit(f"{run_dir}: no checkpoint to read method.dmd_denoising_steps from; pass --student_steps")
    recipe = saved_recipe(read_metadata(ckpt))
    if recipe.get("method.dmd_denoising_steps") is None:
        raise SystemExit(f"{ckpt}/metadata.json: its recipe has no method.dmd_denoising_steps; pass --student_steps")
    recorded = bool(recipe.get("method.warp_denoising_step", False))
    return [int(s) for s in recipe["method.dmd_denoising_steps"]], recorded if warp is None else bool(warp)


def caption_conditions(modes: Any, model: Any, text_max_length: int) -> dict[str, Any]:
    """Each caption's conditioning for `model`: its text columns from the dataset, padded as in
    training."""
    from fv_accel.data.loader import LatentDataset

    dataset = LatentDataset(str(modes.data_dir / "latents"), text_max_length=text_max_length)
    conds: dict[str, Any] = {}
    for row in range(len(dataset)):
        item = dataset[(row, 0, 0)]
        if item["caption"] not in conds:
            columns = {k: v[None] for k, v in item.items() if isinstance(v, torch.Tensor) and k.startswith("text_")}
            conds[item["caption"]] = model.build_conditioning(columns)
    return conds


def seeded_noise(shape: tuple, seeds: list[int]) -> torch.Tensor:
    """One [C, T, H, W] noise per seed (its own generator), stacked: the same for every sampler."""
    return torch.cat([torch.randn((1, *shape), generator=torch.Generator().manual_seed(s)) for s in seeds])


def measure(
    name: str, sampler: Callable[[Callable, torch.Tensor], torch.Tensor], model: Any, modes: Any,
    conds: dict[str, Any], seeds: list[int],
) -> dict:
    """One sampler over every caption and seed: forwards and wall time per sample, distances."""
    latent, track, seconds, calls, samples = [], [], 0.0, 0, 0
    for caption in modes.captions:
        clips = modes.latents[caption]
        noise = seeded_noise(tuple(clips.shape[1:]), seeds)
        velocity = CountingVelocity(model, conds[caption])
        start = time.perf_counter()
        with torch.no_grad():
            out = sampler(velocity, noise)
        seconds += time.perf_counter() - start
        calls += velocity.calls * len(seeds)
        samples += len(seeds)
        nearest = modes.nearest(out, caption)
        latent += nearest["latent"].tolist()
        track += nearest["track"].tolist()
    return {
        "sampler": name, "forwards_per_sample": calls / samples, "seconds_per_sample": seconds / samples,
        "latent_distance": float(np.mean(latent)), "track_distance_px": float(np.nanmean(track)),
        "latent_distance_per_sample": latent, "track_distance_px_per_sample": track,
    }


def clips_reference(modes: Any) -> dict:
    """Each clip against the other clips of its caption (how far apart the modes are)."""
    latent, track = [], []
    for caption in modes.captions:
        clips = modes.latents[caption]
        lat = modes.latent_distances(clips, caption)
        trk = modes.track_distances(clips, caption)
        n = clips.shape[0]
        off = ~np.eye(n, dtype=bool)
        latent += lat.numpy()[off].reshape(n, n - 1).min(axis=1).tolist()
        track += trk[off].reshape(n, n - 1).min(axis=1).tolist()
    return {"sampler": "clips (nearest other clip of the caption)", "latent_distance": float(np.mean(latent)),
            "track_distance_px": float(np.mean(track))}


def shown(path: Any) -> str:
    """A path as the results show it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(C.REPO)) if path.is_relative_to(C.REPO) else str(path)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--teacher", type=Path, default=C.REPO / "outputs" / "tiny_dmd2_teacher", help="the teacher's run folder")
    p.add_argument("--teacher_config", default=str(C.REPO / TEACHER_RECIPE), help="the teacher's recipe (its world and model)")
    p.add_argument("--teacher_steps", type=int, default=30, help="the teacher's own Euler step count")
    p.add_argument("--few_steps", type=int, nargs="+", default=[4, 2], help="the teacher's few-step Euler counts")
    p.add_argument("--shift", type=float, default=3.0, help="the Euler sampling shift")
    p.add_argument("--student", type=Path, nargs="*", default=[], help="DMD2 student run folder(s)")
    p.add_argument("--student_config", default=None, help="the students' recipe (default: the teacher's)")
    p.add_argument("--student_steps", type=int, nargs="*", default=None, help="e.g. 1000 750 500 250")
    p.add_argument("--student_warp", action=argparse.BooleanOptionalAction, default=None,
                   help="warp the steps through the training table (default: as the student's recipe)")
    p.add_argument("--seeds", type=int, default=8, help="seeds per caption (0 .. seeds-1)")
    p.add_argument("--out", type=Path, default=C.RESULTS_DIR)
    p.add_argument("--name", default="distill", help="the results' file name")
    return p.parse_args(argv)


def run_samplers(args: argparse.Namespace, modes: Any, text_max_length: int) -> list[dict]:
    from fv_accel.sampling import dmd_denoising_timesteps, euler_sample, few_step_sample
    from fv_accel.schedulers import FlowMatchTable

    seeds = list(range(args.seeds))
    teacher = load_model(args.teacher_config, args.teacher)
    conds = caption_conditions(modes, teacher, text_max_length)
    rows = []
    for steps in [args.teacher_steps, *args.few_steps]:
        sampler = lambda v, noise, n=steps: euler_sample(v, noise, n, shift=args.shift)  # noqa: E731
        rows.append(measure(f"teacher, Euler {steps} steps", sampler, teacher, modes, conds, seeds))
    table = FlowMatchTable(args.shift)
    for run_dir in args.student:
        steps, warp = student_schedule(run_dir, args.student_steps, args.student_warp)
        timesteps = dmd_denoising_timesteps(steps, table, warp)
        student = load_model(args.student_config or args.teacher_config, run_dir)

        def sampler(v: Callable, noise: torch.Tensor, t=timesteps) -> torch.Tensor:
            gens = [torch.Generator().manual_seed(10_000 + s) for s in seeds]  # the re-noising draws
            return few_step_sample(v, noise, t, table, gens)

        name = f"student {shown(run_dir)}, DMD {len(steps)} steps {steps}{' warped' if warp else ''}"
        rows.append(measure(name, sampler, student, modes, caption_conditions(modes, student, text_max_length), seeds))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    from fv_accel.config import load_config
    from fv_accel.tiny import tiny_clip_modes

    args = parse_args(argv)
    info = C.machine_info()
    cfg = load_config(args.teacher_config)
    if cfg.training.data.data_path != "tiny" or cfg.training.data.tiny_world != "multimodal":
        raise SystemExit(f"{args.teacher_config}: training.data is not the multimodal tiny world")
    modes = tiny_clip_modes(cfg.training.data)
    rows = run_samplers(args, modes, cfg.training.data.text_max_length)
    reference = clips_reference(modes)
    payload = {
        "machine": info, "command": C.command_line("distill.py", argv if argv is not None else sys.argv[1:]),
        "captions": {c: modes.clips_of(c) for c in modes.captions}, "seeds": args.seeds, "shift": args.shift, "teacher_steps": args.teacher_steps,
        "teacher": shown(args.teacher), "teacher_config": shown(args.teacher_config), "rows": rows, "reference": reference,
    }
    table = [[r["sampler"], f"{r['forwards_per_sample']:g}", f"{r['seconds_per_sample'] * 1000:.1f}",
              f"{r['latent_distance']:.3f}", f"{r['track_distance_px']:.2f}"] for r in rows]
    table.append([reference["sampler"], "-", "-", f"{reference['latent_distance']:.3f}", f"{reference['track_distance_px']:.2f}"])
    header = ["sampler", "forwards/sample", "ms/sample", "latent distance (RMS)", "track distance (px)"]
    captions = ", ".join(f"{c!r} ({n} clips)" for c, n in payload["captions"].items())
    markdown = (
        f"Machine: {C.machine_line(info)}.\n\nCommand: `{payload['command']}`\n\n"
        f"Teacher {payload['teacher']}/transformer ({payload['teacher_steps']} Euler steps at shift {args.shift} is its own "
        f"count). Multimodal tiny world ({payload['teacher_config']}): {captions}; {args.seeds} seeds per caption. "
        "Distances: to the nearest clip of the sample's caption, mean over captions and seeds.\n\n"
        f"{C.markdown_table(header, table)}\n"
    )
    C.publish_results(args.out, args.name, payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
