"""Streaming: time to the first chunk, frames per second and quality of block-causal few-step
students against the teacher at its own steps, measured side by side in one run.

    python benchmarks/streaming.py                 # the tiny chain (docs/distillation.md)
    python benchmarks/streaming.py --size small    # timing only: configs/bench_small.yaml's Wan, random weights

Tiny (default): the multimodal tiny world's captions, `--seeds` seeded noises each (the same noise
for every sampler), on the runs of the tiny Self-Forcing chain: the teacher
(outputs/tiny_dmd2_teacher, bidirectional, whole clips, Euler at its own `--teacher_steps`), the
causal DFSFT student (outputs/tiny_dfsft_causal_multimodal) streamed chunk by chunk over its KV
cache with Euler at 4 steps, and the Self-Forcing student (outputs/tiny_self_forcing) streamed at
its own 4 steps (student_steps.json: x0, re-noised with fresh noise between steps). Per sampler:
transformer forwards per sample, time to the first chunk (the teacher's first frames come with its
whole clip), latent frames per second, both as ratios to the teacher's; and the distances of
benchmarks/distill.py (to the nearest clip of the sample's caption: RMS over the latent, and the
shape's centre track in pixels).

Small: the same timing on configs/bench_small.yaml's Wan at `--frames` x `--height` x `--width`,
random weights (quality not measured): the model as a block-causal student streamed at 4 steps
against the same weights bidirectional at `--teacher_steps` Euler steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import distill as D  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

CAUSAL_RECIPE = "configs/tiny_dfsft_causal_multimodal.yaml"


def stream(student: Any, noise: torch.Tensor, text: torch.Tensor, **schedule: Any) -> tuple[torch.Tensor, float, float, int]:
    """(latents, seconds to the first chunk, seconds in all, forwards) of a KV-cached rollout."""
    from fv_accel.rollout import _CountingPredictor, iter_kv_cached_rollout

    predict = _CountingPredictor(student)
    out = noise.clone()
    start, first = time.perf_counter(), None
    with torch.no_grad():
        for chunk in iter_kv_cached_rollout(student, noise, text, predictor=predict, **schedule):
            first = time.perf_counter() - start if first is None else first
            out[:, :, chunk.start : chunk.end] = chunk.latents
    return out, first, time.perf_counter() - start, predict.calls


def whole(model: Any, noise: torch.Tensor, cond: Any, steps: int, shift: float) -> tuple[torch.Tensor, float, float, int]:
    from fv_accel.sampling import euler_sample

    velocity = D.CountingVelocity(model, cond)
    start = time.perf_counter()
    with torch.no_grad():
        out = euler_sample(velocity, noise, steps, shift=shift)
    seconds = time.perf_counter() - start
    return out, seconds, seconds, velocity.calls


def row(name: str, results: list, modes: Any = None, captions: Optional[list] = None) -> dict:
    """One sampler's figures over its batches: results are (latents, first, total, forwards, batch size)."""
    samples = sum(r[4] for r in results)
    frames = sum(r[0].shape[2] * r[4] for r in results)
    out = {
        "sampler": name, "forwards_per_sample": sum(r[3] * r[4] for r in results) / samples,
        "first_chunk_s": float(np.mean([r[1] for r in results])), "total_s": float(np.mean([r[2] for r in results])),
        "latent_frames_per_s": frames / sum(r[2] for r in results),
    }
    if modes is not None:
        latent, track = [], []
        for caption, r in zip(captions, results):
            nearest = modes.nearest(r[0], caption)
            latent += nearest["latent"].tolist()
            track += nearest["track"].tolist()
        out.update(latent_distance=float(np.mean(latent)), track_distance_px=float(np.nanmean(track)))
    return out


def student_schedule(run_dir: Path) -> dict:
    """A distilled student's own steps from its student_steps.json, as the rollout takes them."""
    import json

    from fv_accel.methods.distribution_matching.dmd2 import STUDENT_STEPS_FILE

    path = run_dir / STUDENT_STEPS_FILE
    if not path.is_file():
        raise SystemExit(f"{path}: missing (train the run first: see docs/distillation.md)")
    record = json.loads(path.read_text())
    return {
        "sigmas": record["sigmas"] + [0.0], "timesteps": record["timesteps"],
        "renoise": record.get("student_sample_type", "sde") == "sde", "steps": list(record["timesteps"]),
    }


def tiny_rows(args: argparse.Namespace) -> tuple[list[dict], dict]:
    from fv_accel.config import load_config
    from fv_accel.tiny import tiny_clip_modes

    cfg = load_config(D.TEACHER_RECIPE)
    modes = tiny_clip_modes(cfg.training.data)
    seeds = list(range(args.seeds))
    teacher = D.load_model(D.TEACHER_RECIPE, args.teacher)
    dfsft = D.load_model(CAUSAL_RECIPE, args.dfsft)
    sf = D.load_model(CAUSAL_RECIPE, args.self_forcing)
    sf_steps = student_schedule(args.self_forcing)
    length = cfg.training.data.text_max_length
    conds = {name: D.caption_conditions(modes, m, length) for name, m in (("t", teacher), ("d", dfsft), ("s", sf))}
    results: dict[str, list] = {"teacher": [], "dfsft": [], "sf": []}
    captions = list(modes.captions)
    for _ in range(args.rounds):  # interleaved: each round runs every sampler on every caption
        for caption in captions:
            noise = D.seeded_noise(tuple(modes.latents[caption].shape[1:]), seeds)
            n = len(seeds)
            results["teacher"].append((*whole(teacher, noise, conds["t"][caption], args.teacher_steps, args.shift), n))
            results["dfsft"].append((*stream(dfsft, noise, conds["d"][caption].text, num_steps=4, shift=args.shift), n))
            torch.manual_seed(10_000)
            schedule = {k: v for k, v in sf_steps.items() if k != "steps"}
            results["sf"].append((*stream(sf, noise, conds["s"][caption].text, generator=torch.Generator().manual_seed(10_000), **schedule), n))
    per_round = captions * args.rounds
    rows = [
        row(f"teacher {D.shown(args.teacher)}, bidirectional, Euler {args.teacher_steps} steps", results["teacher"], modes, per_round),
        row(f"causal DFSFT {D.shown(args.dfsft)}, streamed, Euler 4 steps", results["dfsft"], modes, per_round),
        row(f"Self-Forcing {D.shown(args.self_forcing)}, streamed, its 4 steps {sf_steps['steps']}", results["sf"], modes, per_round),
    ]
    return rows, {"captions": {c: modes.clips_of(c) for c in captions}, "reference": D.clips_reference(modes)}


def small_rows(args: argparse.Namespace) -> tuple[list[dict], dict]:
    from fv_accel.config import load_config
    from fv_accel.models import build_student

    over = {"models.student.causal": True, "method.name": "dfsft", "method.chunk_size": 3}
    causal = build_student(load_config("configs/bench_small.yaml", over))
    bidirectional = build_student(load_config("configs/bench_small.yaml"))
    bidirectional.transformer.load_state_dict(causal.transformer.state_dict())
    for m in (causal, bidirectional):
        m.transformer.eval()
    latent_t = (args.frames - 1) // 4 + 1
    shape = (1, causal.in_channels, latent_t, args.height // 8, args.width // 8)
    text = torch.zeros(1, 16, causal.transformer.config.text_dim)
    cond = causal.build_conditioning({"text_embedding": text, "text_attention_mask": torch.ones(1, 16, dtype=torch.long)})
    results: dict[str, list] = {"teacher": [], "causal": []}
    for r in range(args.rounds):
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(r))
        results["teacher"].append((*whole(bidirectional, noise, cond, args.teacher_steps, args.shift), 1))
        results["causal"].append((*stream(causal, noise, cond.text, num_steps=4, shift=args.shift), 1))
    rows = [
        row(f"bench_small Wan, bidirectional, Euler {args.teacher_steps} steps", results["teacher"]),
        row("bench_small Wan, block-causal (chunks of 3), streamed, 4 steps", results["causal"]),
    ]
    return rows, {"shape": list(shape)}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--teacher", type=Path, default=C.REPO / "outputs" / "tiny_dmd2_teacher")
    p.add_argument("--dfsft", type=Path, default=C.REPO / "outputs" / "tiny_dfsft_causal_multimodal")
    p.add_argument("--self_forcing", type=Path, default=C.REPO / "outputs" / "tiny_self_forcing")
    p.add_argument("--teacher_steps", type=int, default=30, help="the teacher's own Euler step count")
    p.add_argument("--shift", type=float, default=3.0, help="the Euler sampling shift")
    p.add_argument("--seeds", type=int, default=8, help="seeds per caption (tiny)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds")
    p.add_argument("--frames", type=int, default=33, help="video frames (small)")
    p.add_argument("--height", type=int, default=240)
    p.add_argument("--width", type=int, default=416)
    p.add_argument("--out", type=Path, default=C.RESULTS_DIR)
    p.add_argument("--name", default=None, help="the results' file name (default streaming_<size>)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    info = C.machine_info()
    torch.manual_seed(0)
    rows, extra = tiny_rows(args) if args.size == "tiny" else small_rows(args)
    base = rows[0]
    for r in rows:
        r["first_chunk_ratio"] = r["first_chunk_s"] / base["first_chunk_s"]
        r["fps_ratio"] = r["latent_frames_per_s"] / base["latent_frames_per_s"]
    header = ["sampler", "forwards/sample", "first chunk (ms)", "x teacher", "latent frames/s", "x teacher"]
    quality = "latent_distance" in rows[0]
    if quality:
        header += ["latent distance (RMS)", "track distance (px)"]
    table = []
    for r in rows:
        line = [r["sampler"], f"{r['forwards_per_sample']:g}", f"{r['first_chunk_s'] * 1000:.1f}", f"{r['first_chunk_ratio']:.3f}",
                f"{r['latent_frames_per_s']:.3g}", f"{r['fps_ratio']:.2f}"]
        if quality:
            line += [f"{r['latent_distance']:.3f}", f"{r['track_distance_px']:.2f}"]
        table.append(line)
    if quality:
        ref = extra["reference"]
        table.append([ref["sampler"], "-", "-", "-", "-", "-", f"{ref['latent_distance']:.3f}", f"{ref['track_distance_px']:.2f}"])
    payload = {"machine": info, "command": C.command_line("streaming.py", argv if argv is not None else sys.argv[1:]),
               "rows": rows, **{k: v for k, v in extra.items() if k != "reference"}}
    markdown = (
        f"Machine: {C.machine_line(info)}.\n\nCommand: `{payload['command']}`\n\n"
        "Times are wall seconds of the samplers alone (no decoding), measured side by side in one run; a teacher's first "
        "chunk comes with its whole clip. Ratios are to the first row.\n\n"
        f"{C.markdown_table(header, table)}\n"
    )
    C.publish_results(args.out, args.name or f"streaming_{args.size}", payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
