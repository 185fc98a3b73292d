"""Which start makes the best streaming student: the three starts of a Self-Forcing student (causal
DFSFT on data, KD on the teacher's ODE trajectories, causal consistency distillation over a
teacher-forcing run), each by itself and the Self-Forcing student made from it at the same
Self-Forcing steps, on the multimodal tiny world, side by side in one run.

    python benchmarks/starts.py          # the runs of docs/distillation.md's three tiny chains

Every sampler gets the same prompts (the world's captions) and the same seeded noises
(`--seeds` per caption). The teacher (outputs/tiny_dmd2_teacher) samples whole clips with Euler at
`--teacher_steps`; each start is streamed chunk by chunk over its KV cache with Euler at 4 steps;
the KD start also at its own `t_list` steps, and each Self-Forcing student at its own 4 steps (their
student_steps.json). Per sampler:
forwards per sample, time to the first chunk, and the distances of benchmarks/distill.py to the
nearest clip of the sample's caption (RMS over the normalised latent; the shape's centre track in
pixels). A run folder that does not exist is reported with the command that makes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import distill as D  # noqa: E402
import streaming as S  # noqa: E402
import torch  # noqa: E402

# (label, run folder, the recipe that makes it, how it samples: "start" = Euler 4 steps streamed,
# "sf" = its own few steps streamed, as its student_steps.json gives them)
RUNS = (
    ("causal DFSFT", "tiny_dfsft_causal_multimodal", "configs/tiny_dfsft_causal_multimodal.yaml", "start"),
    ("Self-Forcing from causal DFSFT", "tiny_self_forcing", "configs/tiny_self_forcing.yaml", "sf"),
    ("KD (causal, teacher's ODE trajectories)", "tiny_kd", "configs/tiny_kd.yaml", "start"),
    ("KD at its t_list", "tiny_kd", "configs/tiny_kd.yaml", "sf"),
    ("Self-Forcing from KD", "tiny_self_forcing_from_kd", "configs/tiny_self_forcing_from_kd.yaml", "sf"),
    ("causal CD (from TF-SFT)", "tiny_causal_cd", "configs/tiny_causal_cd.yaml", "start"),
    ("Self-Forcing from causal CD", "tiny_self_forcing_from_cd", "configs/tiny_self_forcing_from_cd.yaml", "sf"),
)


def check_runs(outputs: Path) -> None:
    missing = [(label, recipe) for label, name, recipe, _ in RUNS if not (outputs / name / "transformer" / "config.json").is_file()]
    if missing:
        lines = "\n".join(f"  {label}: make it with the chain of {recipe} (docs/distillation.md)" for label, recipe in missing)
        raise SystemExit(f"missing runs under {outputs}:\n{lines}")


def sample_rows(args: argparse.Namespace) -> tuple[list[dict], dict]:
    from fv_accel.config import load_config
    from fv_accel.tiny import tiny_clip_modes

    cfg = load_config(D.TEACHER_RECIPE)
    modes = tiny_clip_modes(cfg.training.data)
    seeds, captions = list(range(args.seeds)), list(modes.captions)
    length = cfg.training.data.text_max_length
    teacher = D.load_model(D.TEACHER_RECIPE, args.teacher)
    samplers: list[tuple[str, Any, Any, Optional[dict]]] = [("teacher", teacher, D.caption_conditions(modes, teacher, length), None)]
    for label, name, _, kind in RUNS:
        run = args.outputs / name
        model = D.load_model(S.CAUSAL_RECIPE, run)
        schedule = S.student_schedule(run) if kind == "sf" else None
        samplers.append((label, model, D.caption_conditions(modes, model, length), schedule))
    results: dict[str, list] = {label: [] for label, *_ in samplers}
    for caption in captions:
        noise = D.seeded_noise(tuple(modes.latents[caption].shape[1:]), seeds)
        for label, model, conds, schedule in samplers:
            text = conds[caption].text
            if label == "teacher":
                out = S.whole(model, noise, conds[caption], args.teacher_steps, args.shift)
            elif schedule is None:
                out = S.stream(model, noise, text, num_steps=4, shift=args.shift)
            else:
                steps = {k: v for k, v in schedule.items() if k != "steps"}
                out = S.stream(model, noise, text, generator=torch.Generator().manual_seed(10_000), **steps)
            results[label].append((*out, len(seeds)))
    rows = []
    for label, *_ in samplers:
        how = (f"bidirectional, Euler {args.teacher_steps} steps" if label == "teacher" else
               "streamed, Euler 4 steps" if dict((r[0], r[3]) for r in RUNS)[label] == "start" else "streamed, its own 4 steps")
        rows.append(S.row(f"{label}, {how}", results[label], modes, captions))
    return rows, {"reference": D.clips_reference(modes), "captions": {c: modes.clips_of(c) for c in captions}}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--outputs", type=Path, default=C.REPO / "outputs", help="the folder holding the chains' runs")
    p.add_argument("--teacher", type=Path, default=C.REPO / "outputs" / "tiny_dmd2_teacher")
    p.add_argument("--teacher_steps", type=int, default=30)
    p.add_argument("--shift", type=float, default=3.0, help="the Euler sampling shift")
    p.add_argument("--seeds", type=int, default=8, help="seeds per caption")
    p.add_argument("--out", type=Path, default=C.RESULTS_DIR)
    p.add_argument("--name", default="starts_tiny")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    check_runs(args.outputs)
    info = C.machine_info()
    torch.manual_seed(0)
    rows, extra = sample_rows(args)
    base = rows[0]
    header = ["sampler", "forwards/sample", "first chunk (ms)", "x teacher", "latent distance (RMS)", "track distance (px)"]
    table = [[r["sampler"], f"{r['forwards_per_sample']:g}", f"{r['first_chunk_s'] * 1000:.1f}",
              f"{r['first_chunk_s'] / base['first_chunk_s']:.3f}", f"{r['latent_distance']:.3f}", f"{r['track_distance_px']:.2f}"]
             for r in rows]
    ref = extra["reference"]
    table.append([ref["sampler"], "-", "-", "-", f"{ref['latent_distance']:.3f}", f"{ref['track_distance_px']:.2f}"])
    payload = {"machine": info, "command": C.command_line("starts.py", argv if argv is not None else sys.argv[1:]),
               "rows": rows, **{k: v for k, v in extra.items() if k != "reference"}, "reference": ref}
    markdown = (
        f"Machine: {C.machine_line(info)}.\n\nCommand: `{payload['command']}`\n\n"
        f"{len(extra['captions'])} captions x {args.seeds} seeds, the same noise for every sampler. Times are wall seconds "
        "of the samplers alone (no decoding); the teacher's first chunk comes with its whole clip.\n\n"
        f"{C.markdown_table(header, table)}\n"
    )
    C.publish_results(args.out, args.name, payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
