"""Reward training (DiffusionNFT) measured two ways: its held-out reward curve on the tiny world
against a rejection-sampling baseline (`--curve`), and the time split of an outer step on the small
benchmark model (`--timing`).

    python benchmarks/nft.py --curve                  # the tiny teacher (outputs/tiny_dmd2_teacher), 30 outer steps
    python benchmarks/nft.py --timing                 # the small benchmark model, 2 outer steps
    python benchmarks/nft.py --curve --timing         # both
    # smoke test (seconds): an inline random tiny Wan, a few samples
    python benchmarks/nft.py --curve --student random --outer-steps 3 --sample-batch 2 --videos-per-prompt 2 \
        --batches 2 --sampling-steps 2 --val-videos 2 --teacher-seed-sets 2 --rft-steps 2 --rft-batch 2
    python benchmarks/nft.py --timing --timing-batches 1 --timing-batch 1 --timing-steps 2 --sampling-rounds 2

--curve. configs/tiny_nft.yaml run in process (`build_from_config` + `Trainer`) with held-out
validation every outer step (`method.validation.prompts`: `--heldout` captions of the multimodal
tiny world, whose rows are never trained on; `--val-videos` samples each from fixed seeds);
`validation/reward/<reward>` per step is read from `<output_dir>/logs/metrics.jsonl`, the samples
drawn at each point being outer steps x the outer step's samples. The baseline, rejection-sampling
fine-tuning (RFT), draws as many samples: per round, `--rft-every` outer steps' worth, the same
number per trained caption, sampled by the current model with NFT's sampler (`sample_policy`,
`method.sampling`) from per-sample seeds, decoded and scored by the same rewards; the best
`--rft-keep` of each caption are written as a latent dataset in the project's Parquet schema (the
caption's text embedding, the data's latent statistics) and the model is fine-tuned on them with
SFT (`method.name: finetune`, `--rft-steps` steps of `--rft-batch`, a fresh AdamW each round); then
its held-out reward is taken by `RewardValidationCallback.evaluate` on NFT's prompts and seeds (the
teacher's figure is checked to equal the one NFT logged). Also: the teacher's held-out reward over
`--teacher-seed-sets` seed sets (its seed-to-seed spread), both methods' reward on the trained
captions at the same seeds, and each final model's distance to the nearest clip of the caption
(`fv_accel.tiny.modes.ClipModes`, every caption, `--val-videos` seeds) over the teacher's.

--timing. configs/bench_small.yaml's transformer trained by NFT for `--timing-outer-steps` outer
steps on random latents with a cheap user reward (`--reward`, default this module's
`mean_brightness`; or `tiny_left`), decoded by the tiny Wan VAE. Per outer step: the method's
`sample_s`, `decode_s`, `score_s`, `outer_s`; training (its optimizer steps' `step_time` less their
`data_wait`, which holds the sampling phase); and the wall time inside the transformers' forwards
(module hooks), the backward, the optimizer step, the VAE's decode and the rewards' calls
(wrappers; on CUDA each synchronises), the rest being the overhead. Target: overhead <= 3% of the
outer step (the last one: the first pays one-time costs; the optimizer step counts as model work as
in step_overhead.py, the share without that is shown too). Then sampling speed: `sample_policy`
through the old role's `predict_noise` against a bare `torch.inference_mode()` Euler loop
(x += (sigma_next - sigma) * transformer(x, t, text)) on the same transformer, latents, batch and
steps, interleaved rounds, the median of the per-round time ratios ours / bare. Target: ours at
least 0.97x the bare loop's speed (time ratio <= 1 / 0.97).

Results: `benchmarks/results/<name>_curve_<date>.md` / `<name>_timing_<date>.md` (and .json).
No test asserts a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from fv_accel.trainer import TrainerCallback  # noqa: E402

NFT_RECIPE = C.REPO / "configs" / "tiny_nft.yaml"
SFT_RECIPE = C.REPO / "configs" / "tiny_finetune.yaml"
SMALL_RECIPE = C.REPO / "configs" / "bench_small.yaml"
DEFAULT_TEACHER = C.REPO / "outputs" / "tiny_dmd2_teacher"
# `--student random`: tests/test_nft.py's one-block student (tests/dmd2_helpers.py TINY_TEACHER).
RANDOM_STUDENT = {
    "patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 16,
    "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 64, "num_layers": 1,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32,
}
# The multimodal world's captions that end left or right half of the time (tiny_left's signal).
DEFAULT_HELDOUT = ["a blue circle moving up on a dark background"]
OVERHEAD_TARGET = 0.03
SAMPLING_SPEED_TARGET = 0.97  # ours / bare in speed; the time ratio must be <= 1 / this
# Wall clock, and the process's CPU time (all threads), which other jobs on a shared machine barely move.
CLOCKS = ("wall", "cpu")
# No checkpoints, trackers or plots in the benchmark's runs (logs/metrics.jsonl is still written).
QUIET = {"training.checkpoint.training_state_checkpointing_steps": 0, "training.checkpoint.save_final": False,
         "training.tracker.trackers": ["none"], "training.tracker.write_plots": False}


def mean_brightness(clips: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """A cheap user reward (`--reward nft:mean_brightness`): the clip's mean pixel value in [0, 1]."""
    del prompts
    return clips.float().mean(dim=(1, 2, 3, 4)) / 255.0


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--curve", action="store_true", help="the held-out reward curve, NFT vs RFT, on the tiny world")
    p.add_argument("--timing", action="store_true", help="the time split of an outer step on the small model")
    p.add_argument("--run", type=Path, default=None,
                   help="a finished tiny_nft run folder: its EMA weights' (else its transformer's) distance to the nearest clip, "
                        "on the held-out captions and on every caption, against the teacher's")
    g = p.add_argument_group("curve")
    g.add_argument("--student", default=str(DEFAULT_TEACHER), help="the run folder to start from, or 'random' (a one-block inline Wan)")
    g.add_argument("--outer-steps", type=int, default=30, help="NFT outer steps (the recipe's 120 optimizer steps are 30)")
    g.add_argument("--sample-batch", type=int, default=None, help="method.sample_train_batch_size (default: the recipe's)")
    g.add_argument("--videos-per-prompt", type=int, default=None, help="method.num_video_per_prompt (default: the recipe's)")
    g.add_argument("--batches", type=int, default=None, help="method.num_batches_per_epoch (default: the recipe's)")
    g.add_argument("--train-batch", type=int, default=None, help="method.train_batch_size (default: the sample batch)")
    g.add_argument("--sampling-steps", type=int, default=None, help="method.sampling.num_steps (default: the recipe's)")
    g.add_argument("--heldout", nargs="+", default=DEFAULT_HELDOUT, help="held-out captions (method.validation.prompts)")
    g.add_argument("--val-videos", type=int, default=8, help="samples per held-out prompt (method.validation.videos_per_prompt)")
    g.add_argument("--val-steps", type=int, default=None, help="method.validation.num_steps (default: the sampling steps)")
    g.add_argument("--val-seed", type=int, default=42, help="method.validation.seed")
    g.add_argument("--teacher-seed-sets", type=int, default=5, help="seed sets of the teacher's held-out reward (val-seed, +1, ...)")
    g.add_argument("--no-trained-prompts", action="store_true", help="skip the reward on the trained captions")
    g.add_argument("--rft-every", type=int, default=None,
                   help="outer steps' worth of samples per RFT round (default: the fewest that split evenly over the trained captions)")
    g.add_argument("--rft-keep", type=float, default=0.25, help="the best-scored share of each caption's samples kept")
    g.add_argument("--rft-steps", type=int, default=32, help="SFT optimizer steps per RFT round")
    g.add_argument("--rft-batch", type=int, default=8, help="SFT batch size")
    g.add_argument("--rft-lr", type=float, default=1e-4, help="SFT learning rate (constant; NFT's recipe trains at 1e-4)")
    g.add_argument("--rft-accumulate", action="store_true", help="fine-tune each round on every round's kept samples so far")
    g = p.add_argument_group("timing")
    g.add_argument("--timing-outer-steps", type=int, default=2)
    g.add_argument("--timing-batches", type=int, default=4, help="method.num_batches_per_epoch")
    g.add_argument("--timing-batch", type=int, default=2, help="method.sample_train_batch_size = num_video_per_prompt = train_batch_size")
    g.add_argument("--timing-steps", type=int, default=10, help="method.sampling.num_steps")
    g.add_argument("--reward", default="nft:mean_brightness", help="the reward: module:function, or tiny_left")
    g.add_argument("--sampling-rounds", type=int, default=8, help="interleaved rounds of ours vs the bare sampling loop")
    g.add_argument("--sampling-reps", type=int, default=1, help="samplings of each per round")
    p.add_argument("--out", type=Path, default=C.RESULTS_DIR)
    p.add_argument("--work-dir", type=Path, default=C.WORK_DIR, help="datasets and scratch run folders")
    p.add_argument("--name", default="nft", help="results go to <name>_curve_<date> and <name>_timing_<date>")
    p.add_argument("--keep", action="store_true", help="keep the scratch run folders")
    args = p.parse_args(argv)
    if not (args.curve or args.timing or args.run):
        p.error("choose --curve, --timing and/or --run RUN")
    return args


# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------
def quietly(fn: Any, *a: Any, **kw: Any) -> Any:
    """`fn` with its stdout/stderr (the run summary table, progress bars) kept off the console."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*a, **kw)


def unwrapped(role: Any) -> torch.nn.Module:
    acc = getattr(role, "accelerator", None)
    return acc.unwrap_model(role.transformer) if acc is not None else role.transformer


def weights_of(role: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in unwrapped(role).state_dict().items()}


def sampler_host(method: Any, accelerator: Any) -> Any:
    """What `RewardValidationCallback.evaluate` reads of a trainer: the method (sampler, decode,
    rewards) and the accelerator."""
    return SimpleNamespace(method=method, accelerator=accelerator)


def prompt_evaluator(cfg: Any, method: Any, loader: Any, prompts: Sequence[str], **spec: Any) -> Any:
    """A `RewardValidationCallback` of NFT's validation settings over `prompts` (rows of the data),
    its conditioning built: `.evaluate(host, role, use_ema=False)` samples them at its seeds."""
    from fv_accel.reward_validation import RewardValidationCallback, held_out_conditioning

    val = dataclasses.replace(cfg.method.validation, prompts=list(prompts), log_samples=False, **spec)
    cfg = dataclasses.replace(cfg, method=dataclasses.replace(cfg.method, validation=val))
    evaluator = RewardValidationCallback(cfg)
    evaluator.prompts, evaluator.conditioning, evaluator.shapes = held_out_conditioning(cfg, method, loader)
    return evaluator


def at_seed(evaluator: Any, seed: int) -> Any:
    evaluator.spec = dataclasses.replace(evaluator.spec, seed=int(seed))
    return evaluator


def sample_prompts(method: Any, role: Any, evaluator: Any, sampling: Any, n: int, tag: str) -> list[torch.Tensor]:
    """`n` clean latents per prompt of `evaluator` from `role` along `sampling`, sample v of prompt p
    from its own generator (derived_seed(seed, tag, p, v)), in batches of the method's sample batch."""
    from fv_accel.methods.rl.sampling import sample_policy, sampling_schedule
    from fv_accel.models.base import TrainingBatch
    from fv_accel.seeding import derived_seed

    role.transformer.eval()
    out = []
    for p, (cond, latent) in enumerate(zip(evaluator.conditioning, evaluator.shapes)):
        xs = []
        for start in range(0, n, method.sample_batch):
            k = min(method.sample_batch, n - start)
            shape = (k, *latent)
            tb = TrainingBatch(conditioning=cond.select(torch.zeros(k, dtype=torch.long, device=cond.text.device)))
            gens = [torch.Generator(device=method.device).manual_seed(derived_seed(evaluator.spec.seed, tag, p, start + v))
                    for v in range(k)]
            schedule = sampling_schedule(method.sampling_shift(shape), sampling, method.device)
            xs.append(sample_policy(role, tb, shape, schedule, sampling.trajectory, gens, predict=method.predict_override))
        out.append(torch.cat(xs))
    return out


# ---------------------------------------------------------------------------------------------
# --curve
# ---------------------------------------------------------------------------------------------
def student_overrides(student: str) -> dict:
    if student == "random":
        return {"models.student.init_from": None, "models.student.model_class": "auto",
                "models.student.transformer_config": dict(RANDOM_STUDENT)}
    folder = Path(student)
    if not (folder / "transformer" / "config.json").is_file():
        raise SystemExit(f"{folder}: no transformer/config.json; train the teacher first "
                         "(accelerate launch train_finetune.py --config configs/tiny_dmd2_teacher.yaml) or pass --student random")
    return {"models.student.init_from": str(folder), "models.student.model_class": "auto"}


def nft_overrides(args: argparse.Namespace, out_dir: Path) -> dict:
    out = {
        **student_overrides(args.student),
        "method.validation.prompts": list(args.heldout),
        "method.validation.every_steps": 1,  # one outer step, set once the run is built
        "method.validation.videos_per_prompt": args.val_videos,
        "method.validation.seed": args.val_seed,
        "method.validation.log_samples": False,
        "training.tracker.log_every": 1,  # every optimizer step's figures in logs/metrics.jsonl
        "training.checkpoint.output_dir": str(out_dir),
        **QUIET,
    }
    for key, value in (("method.sampling.num_steps", args.sampling_steps), ("method.sample_train_batch_size", args.sample_batch),
                       ("method.num_video_per_prompt", args.videos_per_prompt), ("method.num_batches_per_epoch", args.batches),
                       ("method.train_batch_size", args.train_batch or args.sample_batch)):
        if value is not None:
            out[key] = value
    return out


class PromptProbe(TrainerCallback):
    """The reward of other prompts (the trained captions) at the start (the reference) and after every
    outer step (the student), at the held-out validation's seeds; kept, not logged."""

    def __init__(self, cfg: Any, prompts: Sequence[str], steps_per_outer: int):
        self.cfg, self.prompts, self.every = cfg, list(prompts), steps_per_outer
        self.evaluator: Any = None
        self.history: list[tuple[int, dict]] = []

    def on_train_start(self, trainer: Any) -> None:
        self.evaluator = prompt_evaluator(self.cfg, trainer.method, trainer.dataloader, self.prompts)
        self.history.append((0, self.evaluator.evaluate(trainer, trainer.method.reference, use_ema=False)))

    def on_step_end(self, trainer: Any, step: int, logs: dict) -> None:
        if step % self.every == 0:
            self.history.append((step, self.evaluator.evaluate(trainer, trainer.method.student, use_ema=False)))


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def nft_points(metrics: list[dict], reward: str, spo: int, per_outer: int, probe: Optional[PromptProbe]) -> list[dict]:
    """Per outer step (0: the reference): samples drawn, the held-out reward NFT logged, the training
    samples' reward and the trained captions' reward."""
    ref = [m for m in metrics if f"validation/reference/reward/{reward}" in m]
    points = [{"outer": 0, "samples": 0, "heldout": ref[0][f"validation/reference/reward/{reward}"] if ref else math.nan,
               "heldout_std": ref[0].get(f"validation/reference/reward/{reward}_std", math.nan) if ref else math.nan}]
    train = {m["step"]: m[f"reward/{reward}"] for m in metrics if f"reward/{reward}" in m}
    for m in metrics:
        if f"validation/reward/{reward}" in m and m["step"] % spo == 0:
            outer = m["step"] // spo
            points.append({"outer": outer, "samples": outer * per_outer, "heldout": m[f"validation/reward/{reward}"],
                           "heldout_std": m.get(f"validation/reward/{reward}_std", math.nan),
                           "train_samples": train.get((outer - 1) * spo + 1, math.nan)})
    trained = dict(probe.history) if probe is not None else {}
    for pt in points:
        if pt["outer"] * spo in trained:
            pt["trained"] = trained[pt["outer"] * spo].get(f"reward/{reward}", math.nan)
    return points


def run_nft(args: argparse.Namespace, scratch: Path) -> dict:
    """NFT through the Trainer; the run, its outer-step size and its points."""
    from fv_accel.build import build_from_config
    from fv_accel.config import load_config
    from fv_accel.rewards import parse_reward_fn
    from fv_accel.trainer import Trainer

    overrides = nft_overrides(args, scratch / "nft")
    # The held-out samples at the training sampler's step count unless --val-steps says otherwise.
    steps = args.val_steps or load_config(str(NFT_RECIPE), overrides).method.sampling.num_steps
    overrides["method.validation.num_steps"] = steps
    run = build_from_config(str(NFT_RECIPE), overrides)
    method = run.method
    # An outer step's optimizer steps are the method's to count: validation every outer step, and
    # the run's length, are set once it is built (the Trainer and the callback read them live).
    spo = method.steps_per_outer
    run.config.method.validation.every_steps = spo
    run.config.training.loop.max_train_steps = args.outer_steps * spo
    captions = list(method.caption_rows(run.dataloader.dataset))
    missing = [c for c in args.heldout if c not in captions]
    if missing:
        raise SystemExit(f"--heldout {missing[0]!r} is no caption of the data: {captions}")
    trained = [c for c in captions if c not in args.heldout]
    start = weights_of(method.student)
    # RFT's first round samples with the reference and fine-tunes `start`: they must be one model.
    if any(not torch.equal(start[k], v) for k, v in unwrapped(method.reference).state_dict().items()):
        raise RuntimeError("the reference does not hold the student's starting weights")
    probe = None if args.no_trained_prompts else PromptProbe(run.config, trained, spo)
    per_outer = int(run.config.method.num_batches_per_epoch) * method.sample_batch * method.dp_size
    print(f"[curve] NFT: {args.outer_steps} outer steps of {per_outer} samples ({spo} optimizer steps each); "
          f"held out {args.heldout}, trained on {trained}", flush=True)
    t0 = time.perf_counter()
    trainer = Trainer(run, callbacks=list(run.callbacks) + ([probe] if probe else []))
    quietly(trainer.run)
    reward = parse_reward_fn(run.config.method.reward_fn).names[0]
    metrics = read_metrics(Path(trainer.output_dir) / "logs" / "metrics.jsonl")
    points = nft_points(metrics, reward, spo, per_outer, probe)
    return {"run": run, "spo": spo, "per_outer": per_outer, "reward": reward, "captions": captions, "trained": trained,
            "start": start, "points": points, "probe": probe, "seconds": time.perf_counter() - t0}


def rft_samples(
    method: Any, role: Any, evaluator: Any, per_prompt: int, keep: int, round_: int, reward: str
) -> tuple[list, dict]:
    """One RFT round's sampling: `per_prompt` samples of each trained caption from `role` along NFT's
    sampler (per-sample seeds of the round), decoded and scored; the `keep` best of each caption."""
    kept, drawn, best = [], [], []
    latents = sample_prompts(method, role, evaluator, method.cfg.method.sampling, per_prompt, f"rft-round-{round_}")
    for prompt, x0 in zip(evaluator.prompts, latents):
        scores, invalid = method.score(method.decode_for_reward(x0), [prompt] * x0.shape[0])
        avg = torch.where(invalid.to(scores["avg"].device), torch.full_like(scores["avg"], -math.inf), scores["avg"])
        order = torch.argsort(avg.cpu(), descending=True)[:keep]
        kept += [(prompt, x0[i].detach().cpu()) for i in order.tolist()]
        drawn += scores[reward][~invalid.to(scores[reward].device)].cpu().tolist()
        best += scores[reward].cpu()[order].tolist()
    return kept, {"drawn_reward": float(np.mean(drawn)) if drawn else math.nan, "kept_reward": float(np.mean(best))}


def write_rft_dataset(folder: Path, kept: list, method: Any, loader: Any) -> str:
    """The kept samples as a latent dataset (schema.make_row / write_rows): raw latents (the
    student's normalisation undone), the caption's text embedding from its first row, and the
    data's latent statistics and model in fv_dataset.json."""
    from fv_accel.data.schema import make_row, read_dataset_info, write_dataset_info, write_rows

    rows_of = method.caption_rows(loader.dataset)
    texts = {}
    for caption in {c for c, _ in kept}:
        item = loader.dataset[(rows_of[caption][0], 0, 0)]
        texts[caption] = item["text_embedding"][: int(item["text_attention_mask"].sum())].clone()
    mean, std = method.student.latents_mean.cpu(), method.student.latents_std.cpu()
    rows = [make_row(sample_id=f"rft-{i:05d}", latent=(x0[None] * std + mean)[0].contiguous(), text_embedding=texts[caption],
                     caption=caption) for i, (caption, x0) in enumerate(kept)]
    folder.mkdir(parents=True, exist_ok=True)
    write_rows(rows, folder / "data-00000.parquet")
    info = read_dataset_info(loader.dataset.data_path)
    write_dataset_info(folder, model=info.get("model"), latent_stats=(mean.flatten().tolist(), std.flatten().tolist()))
    return str(folder)


def sft_overrides(args: argparse.Namespace, nft_cfg: Any, data_path: str, rows: int, out_dir: Path, round_: int) -> dict:
    opt = nft_cfg.training.optimizer
    return {
        **student_overrides(args.student),
        "method.name": "finetune",
        "training.data.data_path": data_path,
        "training.data.train_batch_size": max(1, min(args.rft_batch, rows)),
        "training.data.text_max_length": nft_cfg.training.data.text_max_length,
        "training.data.seed": round_,
        "training.optimizer.learning_rate": args.rft_lr,
        "training.optimizer.lr_scheduler": "constant",
        "training.optimizer.lr_warmup_steps": 0,
        "training.optimizer.weight_decay": opt.weight_decay,
        "training.optimizer.betas": list(opt.betas),
        "training.loop.max_train_steps": args.rft_steps,
        "training.checkpoint.output_dir": str(out_dir),
        "callbacks.ema.enable": False,
        "callbacks.validation.enable": False,
        **QUIET,
    }


def rft_round_size(per_outer: int, prompts: int, every: Optional[int]) -> tuple[int, int]:
    """(outer steps' worth of samples per round, samples per caption per round)."""
    if every is None:
        every = next(k for k in range(1, prompts + 1) if (k * per_outer) % prompts == 0)
    if (every * per_outer) % prompts:
        raise SystemExit(f"--rft-every {every}: {every} x {per_outer} samples do not split evenly over {prompts} trained captions")
    return every, every * per_outer // prompts


def run_rft(args: argparse.Namespace, nft: dict, heldout: Any, trained_eval: Any, scratch: Path) -> dict:
    """Rejection-sampling fine-tuning rounds at NFT's sample counts; each round's held-out and
    trained-caption reward at the validation seeds."""
    from fv_accel.build import build_from_config
    from fv_accel.config import load_config, micro_batches_per_step
    from fv_accel.trainer import Trainer

    run, method = nft["run"], nft["run"].method
    host = sampler_host(method, run.accelerator)
    sampler = trained_eval if trained_eval is not None else prompt_evaluator(run.config, method, run.dataloader, nft["trained"])
    every, per_prompt = rft_round_size(nft["per_outer"], len(nft["trained"]), args.rft_every)
    keep = max(1, math.ceil(args.rft_keep * per_prompt))
    role, state, pool, points = method.reference, nft["start"], [], []
    rounds = args.outer_steps // every
    print(f"[curve] RFT: {rounds} rounds of {per_prompt} samples per trained caption ({every} outer steps' worth), "
          f"best {keep} kept, {args.rft_steps} SFT steps of {args.rft_batch}", flush=True)
    for r in range(1, rounds + 1):
        kept, figures = rft_samples(method, role, at_seed(sampler, args.val_seed), per_prompt, keep, r, nft["reward"])
        pool = pool + kept if args.rft_accumulate else kept
        data_path = write_rft_dataset(scratch / f"rft-data-{r}", pool, method, run.dataloader)
        overrides = sft_overrides(args, run.config, data_path, len(pool), scratch / f"rft-{r}", r)
        # The one Accelerator of the process, set to the SFT run's accumulation (NFT's counts its
        # trained timesteps as micro-batches; NFT is done training by now).
        run.accelerator.gradient_accumulation_steps = micro_batches_per_step(load_config(str(SFT_RECIPE), overrides))
        sft = build_from_config(str(SFT_RECIPE), overrides, accelerator=run.accelerator)
        unwrapped(sft.method.student).load_state_dict(state)
        if not torch.equal(sft.method.student.latents_mean.cpu(), method.student.latents_mean.cpu()):
            raise RuntimeError("the SFT student normalises latents otherwise than NFT's: the RFT dataset would be read wrong")
        quietly(Trainer(sft).run)
        role, state = sft.method.student, weights_of(sft.method.student)
        point = {"round": r, "samples": r * every * nft["per_outer"], "rows": len(pool), **figures,
                 "heldout": at_seed(heldout, args.val_seed).evaluate(host, role, use_ema=False)[f"reward/{nft['reward']}"]}
        if trained_eval is not None:
            point["trained"] = at_seed(trained_eval, args.val_seed).evaluate(host, role, use_ema=False)[f"reward/{nft['reward']}"]
        points.append(point)
        print(f"[curve] RFT round {r}/{rounds}: {point}", flush=True)
    return {"every": every, "per_prompt": per_prompt, "keep": keep, "points": points, "role": role}


def distances(method: Any, roles: dict[str, Any], evaluator: Any, modes: Any, n: int) -> dict:
    """Each role's samples of every caption (n seeds) against the nearest clip of the caption:
    RMS latent distance and centre-track distance in pixels, means over captions and seeds."""
    out = {}
    for name, role in roles.items():
        latent, track = [], []
        samples = sample_prompts(method, role, evaluator, evaluator_sampling(evaluator), n, "nft-distance")
        for caption, x0 in zip(evaluator.prompts, samples):
            nearest = modes.nearest(x0, caption)
            latent += nearest["latent"].tolist()
            track += nearest["track"].tolist()
        found = np.isfinite(track).any()
        out[name] = {"latent": float(np.mean(latent)), "track_px": float(np.nanmean(track)) if found else math.nan}
    return out


def evaluator_sampling(evaluator: Any) -> Any:
    """The validation sampler: the method's sampling at `method.validation.num_steps`."""
    sampling = evaluator.cfg.method.sampling
    return dataclasses.replace(sampling, num_steps=int(evaluator.spec.num_steps), timesteps=None, sigmas=None)


def run_curve(args: argparse.Namespace, scratch: Path) -> dict:
    from fv_accel.tiny.modes import ClipModes

    nft = run_nft(args, scratch)
    run, method = nft["run"], nft["run"].method
    host, key = sampler_host(method, run.accelerator), f"reward/{nft['reward']}"
    heldout = prompt_evaluator(run.config, method, run.dataloader, args.heldout)
    trained_eval = nft["probe"].evaluator if nft["probe"] is not None else None
    print("[curve] the teacher's held-out reward over seed sets", flush=True)
    teacher = [at_seed(heldout, args.val_seed + s).evaluate(host, method.reference, use_ema=False)[key]
               for s in range(args.teacher_seed_sets)]
    rft = run_rft(args, nft, heldout, trained_eval, scratch)
    print("[curve] distances to the nearest clip of the caption", flush=True)
    modes = ClipModes.load(Path(run.dataloader.dataset.data_path).parent)
    every_caption = at_seed(prompt_evaluator(run.config, method, run.dataloader, modes.captions), args.val_seed)
    dist = distances(method, {"teacher": method.reference, "nft": method.student, "rft": rft.pop("role")}, every_caption, modes,
                     args.val_videos)
    return {
        "benchmark": "nft_curve",
        "student": args.student if args.student == "random" else shown(args.student),
        "recipe": shown(NFT_RECIPE),
        "reward": nft["reward"], "heldout": list(args.heldout), "trained": nft["trained"],
        "samples_per_outer_step": nft["per_outer"], "optimizer_steps_per_outer_step": nft["spo"],
        "validation": {"videos_per_prompt": args.val_videos, "num_steps": run.config.method.validation.num_steps,
                       "seed": args.val_seed},
        "nft": nft["points"], "nft_seconds": nft["seconds"], "rft": rft,
        "teacher_seed_sets": {"seeds": [args.val_seed + s for s in range(args.teacher_seed_sets)], "heldout": teacher},
        # The teacher at the first seed set, evaluated here, against the reference NFT logged (same weights, prompts, seeds).
        "reference_check_abs_diff": abs(teacher[0] - nft["points"][0]["heldout"]) if teacher else math.nan,
        "distances": dist,
    }


def shown(path: Any) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(C.REPO)) if path.is_relative_to(C.REPO) else str(path)


def fmt(x: Any, digits: int = 4) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def curve_markdown(res: dict, info: dict, command: str) -> str:
    rft = {p["samples"]: p for p in res["rft"]["points"]}
    t = res["teacher_seed_sets"]["heldout"]
    t_mean, t_std = (float(np.mean(t)), float(np.std(t))) if t else (math.nan, math.nan)
    rows = []
    for p in res["nft"]:
        r = rft.get(p["samples"], {}) if p["samples"] else {"heldout": p["heldout"], "trained": p.get("trained")}
        rows.append([p["samples"], p["outer"], fmt(p["heldout"]), fmt(r.get("heldout")), fmt(p.get("trained")), fmt(r.get("trained")),
                     fmt(p.get("train_samples")), fmt(r.get("drawn_reward")), f"{fmt(t_mean)} ± {fmt(t_std)}"])
    header = ["samples drawn", "NFT outer step", "NFT held-out", "RFT held-out", "NFT trained captions", "RFT trained captions",
              "NFT's samples drawn (this outer step)", "RFT's samples drawn (this round)", "teacher held-out (mean ± std over seed sets)"]
    d = res["distances"]
    drows = [[name, fmt(v["latent"]), fmt(v["track_px"], 2), fmt(v["latent"] / d["teacher"]["latent"], 3),
              fmt(v["track_px"] / d["teacher"]["track_px"], 3) if d["teacher"]["track_px"] else "-"] for name, v in d.items()]
    rf = res["rft"]
    v = res["validation"]
    return "\n".join([
        "# Reward training on the tiny world: DiffusionNFT vs rejection-sampling fine-tuning",
        "", f"Machine: {C.machine_line(info)}.", "", f"Command: `{command}`", "",
        f"Student: {res['student']}; recipe {res['recipe']}; reward `{res['reward']}`. Held out: {res['heldout']} "
        f"({v['videos_per_prompt']} samples each, seeds from {v['seed']}, {v['num_steps']} sampling steps); trained on "
        f"{res['trained']}. NFT: {res['samples_per_outer_step']} samples per outer step "
        f"({res['optimizer_steps_per_outer_step']} optimizer steps). RFT: rounds of {rf['per_prompt']} samples per trained "
        f"caption ({rf['every']} outer steps' worth), the best {rf['keep']} of each kept and fine-tuned on by SFT. "
        "Rewards: means over the prompts' samples at the validation seeds (row 0: the teacher).",
        "", C.markdown_table(header, rows), "",
        f"The teacher's held-out reward over {len(t)} seed sets: " + ", ".join(fmt(x) for x in t)
        + f" (mean {fmt(t_mean)}, std {fmt(t_std)}); evaluated here at the first seed set it differs from the reference "
        f"figure NFT logged by {res['reference_check_abs_diff']:.2e}.",
        "", "Distance of each final model's samples (every caption, the validation's number of seeds) to the nearest clip "
        "of their caption (fv_accel.tiny.modes.ClipModes), and its ratio to the teacher's:", "",
        C.markdown_table(["model", "latent distance (RMS)", "track distance (px)", "latent / teacher", "track / teacher"], drows),
    ])


# ---------------------------------------------------------------------------------------------
# --timing
# ---------------------------------------------------------------------------------------------
class ModelWork:
    """Wall time inside the model's own work: the transformers' forwards (module hooks), the backward,
    the optimizer step, the VAE's decode and the rewards' calls (wrappers). A span inside another
    (none expected) counts once. On CUDA each span synchronises at both ends."""

    KINDS = ("transformer_forward", "backward", "optimizer", "vae_decode", "reward")

    def __init__(self) -> None:
        self.totals = dict.fromkeys(self.KINDS, 0.0)
        self.calls = dict.fromkeys(self.KINDS, 0)
        self._depth, self._began = 0, 0.0

    def begin(self, *_: Any) -> None:
        if self._depth == 0:
            C.synchronize()
            self._began = time.perf_counter()
        self._depth += 1

    def end(self, kind: str) -> None:
        self._depth -= 1
        if self._depth == 0:
            C.synchronize()
            self.totals[kind] += time.perf_counter() - self._began
            self.calls[kind] += 1

    def hook_module(self, module: torch.nn.Module, kind: str) -> None:
        module.register_forward_pre_hook(self.begin)
        module.register_forward_hook(lambda *_: self.end(kind))

    def wrap(self, owner: Any, attr: str, kind: str) -> None:
        original = getattr(owner, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            self.begin()
            try:
                return original(*a, **kw)
            finally:
                self.end(kind)

        setattr(owner, attr, timed)

    def timed_callable(self, fn: Any, kind: str) -> Any:
        work = self

        class Timed:
            def __call__(self, *a: Any, **kw: Any) -> Any:
                work.begin()
                try:
                    return fn(*a, **kw)
                finally:
                    work.end(kind)

            def __getattr__(self, name: str) -> Any:
                return getattr(fn, name)

        return Timed()

    def take(self) -> tuple[dict, dict]:
        out = (self.totals, self.calls)
        self.totals, self.calls = dict.fromkeys(self.KINDS, 0.0), dict.fromkeys(self.KINDS, 0)
        return out


class OuterClock(TrainerCallback):
    """Each outer step's wall time (from the end of the previous one: everything the loop does,
    logging and callbacks included), its optimizer steps' logs and the model work inside it."""

    def __init__(self, work: ModelWork, steps_per_outer: int):
        self.work, self.spo = work, steps_per_outer
        self.outer: list[dict] = []
        self._steps: list[dict] = []
        self._start = 0.0

    def on_train_start(self, trainer: Any) -> None:
        C.synchronize()
        self.work.take()
        self._start = time.perf_counter()

    def on_step_end(self, trainer: Any, step: int, logs: dict) -> None:
        self._steps.append(dict(logs))
        if step % self.spo:
            return
        C.synchronize()
        now = time.perf_counter()
        totals, calls = self.work.take()
        first = self._steps[0]
        self.outer.append({
            "outer": step // self.spo, "wall_s": now - self._start,
            "training_s": sum(s["step_time"] - s["data_wait"] for s in self._steps),
            **{k: first.get(k, math.nan) for k in ("sample_s", "decode_s", "score_s", "outer_s")},
            "work_s": totals, "work_calls": calls,
        })
        self._steps, self._start = [], now


def tiny_vae_model(work_dir: Path) -> str:
    """A tiny Wan model folder (its VAE decodes the small model's latents for the rewards)."""
    from fv_accel.tiny import tiny_model_defaults, tiny_models

    folder = Path(work_dir) / "tiny-wan-model"
    if not (folder / "model_index.json").is_file():
        tiny_models()[tiny_model_defaults()[0]].write(folder, 0)
    return str(folder)


def timing_overrides(args: argparse.Namespace, data_path: str, model: str, out_dir: Path) -> dict:
    b = args.timing_batch
    return {
        "method.name": "diffusion_nft",
        "method.reward_fn": [{"name": args.reward, "weight": 1.0}],
        "method.sampling.num_steps": args.timing_steps,
        "method.sample_train_batch_size": b, "method.num_video_per_prompt": b, "method.train_batch_size": b,
        "method.num_batches_per_epoch": args.timing_batches,
        "method.ema.enabled": False,
        "training.tracker.log_every": 1,  # the method's time split with every optimizer step
        "training.data.data_path": data_path,
        "training.checkpoint.output_dir": str(out_dir),
        "callbacks.validation.model_from": model,
        "callbacks.validation.enable": False,
        "callbacks.ema.enable": False,
        **QUIET,
    }


def instrument(method: Any, dataset: Any) -> ModelWork:
    """Hooks on every role's transformer, wrappers on backward, the optimizer, the VAE's decode and
    each reward (the VAE and rewards loaded first, so that loading them is not in the timed step)."""
    work = ModelWork()
    for module in {id(r.transformer): r.transformer for r in (method.student, method.old, method.reference)}.values():
        work.hook_module(module, "transformer_forward")
    work.wrap(method, "backward", "backward")
    inner = getattr(method.optimizer, "optimizer", method.optimizer)
    inner.register_step_pre_hook(lambda *_: work.begin())
    inner.register_step_post_hook(lambda *_: work.end("optimizer"))
    item = dataset[(0, 0, 0)]
    clips = method.decode_for_reward(torch.zeros((1, *item["vae_latent"].shape), device=method.device))  # loads the VAE
    method.score(clips, [str(item.get("caption", ""))])  # builds the rewards
    work.wrap(method._vae, "decode", "vae_decode")
    method.rewards.rewards = [work.timed_callable(r, "reward") for r in method.rewards.rewards]
    return work


def split_rows(outer: list[dict]) -> list[dict]:
    """Per outer step: model work, the overhead (the rest) and its share of the outer step."""
    rows = []
    for o in outer:
        w = o["work_s"]
        model = sum(w.values())
        rows.append({**o, "model_work_s": model, "overhead_s": o["wall_s"] - model,
                     "overhead_share": (o["wall_s"] - model) / o["wall_s"],
                     "overhead_share_optimizer_as_overhead": (o["wall_s"] - model + w["optimizer"]) / o["wall_s"]})
    return rows


def sampling_race(method: Any, rounds: int, reps: int) -> dict:
    """`sample_policy` through the old role's `predict_noise` against a bare inference-mode Euler loop
    on the same transformer, conditioning, start noise, schedule and batch, interleaved rounds."""
    from fv_accel.methods.rl.sampling import randn_fastvideo, sample_policy, sampling_schedule
    from fv_accel.models.base import TrainingBatch

    batch, _ = method.prompt_batch(1, 0)
    cond = method.student.build_conditioning(batch)
    tb = TrainingBatch(conditioning=cond)
    shape = (int(batch["sample_index"].shape[0]), *batch["vae_latent"].shape[1:])
    spec = method.cfg.method.sampling
    schedule = sampling_schedule(method.sampling_shift(shape), spec, method.device)
    role, device = method.old, method.device
    transformer, text = role.transformer, cond.text
    timesteps = [t.reshape(1).expand(shape[0]).contiguous() for t in schedule.timesteps]
    dts = [schedule.sigmas[i + 1] - schedule.sigmas[i] for i in range(len(timesteps))]
    role.transformer.eval()

    def ours() -> torch.Tensor:
        return sample_policy(role, tb, shape, schedule, "ode", torch.Generator(device=device).manual_seed(0))

    def bare() -> torch.Tensor:
        with torch.inference_mode():
            x = randn_fastvideo(shape, torch.Generator(device=device).manual_seed(0), device)
            for t, dt in zip(timesteps, dts):
                x = x + dt * transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
            return x

    diff = float((ours().float() - bare().float()).abs().max())  # also the warm-up
    times: dict[str, dict[str, list[float]]] = {c: {"ours": [], "bare": []} for c in CLOCKS}
    runs = {"ours": ours, "bare": bare}
    for r in range(rounds):
        for name in (("bare", "ours") if r % 2 == 0 else ("ours", "bare")):
            start = C.clocks()
            for _ in range(reps):
                runs[name]()
            C.synchronize()
            took = C.since(start)
            times["wall"][name].append(took.wall / reps)
            times["cpu"][name].append(took.cpu / reps)
    ratios = {c: [o / b for o, b in zip(times[c]["ours"], times[c]["bare"])] for c in CLOCKS}
    return {"batch": shape[0], "latent_shape": list(shape[1:]), "steps": len(timesteps), "rounds": rounds, "reps": reps,
            "max_abs_diff": diff, "seconds": {c: {n: C.summarize(v) for n, v in times[c].items()} for c in CLOCKS},
            "time_ratio": {c: C.summarize(v) for c, v in ratios.items()}, "times": times}


def run_timing(args: argparse.Namespace, scratch: Path) -> dict:
    from fv_accel.build import build_from_config
    from fv_accel.trainer import Trainer

    size = C.bench_size("small")
    data_path, data_kind = C.prepare_dataset(args.work_dir, size, max(8, args.timing_batch * args.timing_batches))
    model = tiny_vae_model(args.work_dir)
    run = build_from_config(str(SMALL_RECIPE), timing_overrides(args, data_path, model, scratch / "timing"))
    method = run.method
    spo = method.steps_per_outer
    run.config.training.loop.max_train_steps = args.timing_outer_steps * spo
    trainer = Trainer(run, callbacks=list(run.callbacks))
    work = instrument(method, run.dataloader.dataset)
    clock = OuterClock(work, spo)
    trainer.callbacks.append(clock)  # last: the outer step's wall time holds the other callbacks
    print(f"[timing] {size.describe()}; NFT {args.timing_outer_steps} outer steps of {args.timing_batches} x "
          f"{args.timing_batch} samples, {args.timing_steps} sampling steps, {spo} optimizer steps each; reward {args.reward}",
          flush=True)
    quietly(trainer.run)
    rows = split_rows(clock.outer)
    for row in rows:
        print(f"[timing] outer step {row['outer']}: {row['wall_s']:.2f}s, overhead {row['overhead_share'] * 100:.2f}%", flush=True)
    print(f"[timing] sampling: ours vs a bare Euler loop, {args.sampling_rounds} rounds", flush=True)
    race = sampling_race(method, args.sampling_rounds, args.sampling_reps)
    return {
        "benchmark": "nft_timing", "recipe": shown(SMALL_RECIPE), "latent_shape": list(size.latent_shape),
        "text_shape": list(size.text_shape), "data": data_kind, "vae_from": shown(model), "reward": args.reward,
        "device": str(run.accelerator.device), "mixed_precision": run.accelerator.mixed_precision,
        "params": sum(p.numel() for p in unwrapped(method.student).parameters()),
        "outer_steps": rows, "optimizer_steps_per_outer_step": spo,
        "samples_per_outer_step": args.timing_batches * args.timing_batch, "sampling_steps": args.timing_steps,
        "sampling": race,
    }


def timing_verdicts(res: dict) -> list[tuple[str, float, float, bool]]:
    """(what, measured, target, met): the last outer step's overhead share; the sampling time ratio."""
    last = res["outer_steps"][-1]
    ratio = res["sampling"]["time_ratio"]["wall"]["median"]
    limit = 1 / SAMPLING_SPEED_TARGET
    return [(f"overhead share of outer step {last['outer']}", last["overhead_share"], OVERHEAD_TARGET,
             last["overhead_share"] <= OVERHEAD_TARGET),
            ("sampling time ours / bare, wall (median of rounds)", ratio, limit, ratio <= limit)]


def timing_markdown(res: dict, info: dict, command: str) -> str:
    cols = ("wall_s", "sample_s", "decode_s", "score_s", "outer_s", "training_s")
    rows = [[o["outer"], *(f"{o[c]:.3f}" for c in cols), *(f"{o['work_s'][k]:.3f}" for k in ModelWork.KINDS),
             f"{o['overhead_s']:.3f}", f"{o['overhead_share'] * 100:.2f}%", f"{o['overhead_share_optimizer_as_overhead'] * 100:.2f}%"]
            for o in res["outer_steps"]]
    header = ["outer step", "wall s", "sampling s", "decoding s", "scoring s", "sampling phase s (outer_s)", "training s",
              "transformer fwd s", "backward s", "optimizer s", "VAE decode s", "reward s", "overhead s", "overhead share",
              "share with the optimizer as overhead"]
    s = res["sampling"]
    srows = [[clock, C.fmt_mmm(s["seconds"][clock]["bare"]), C.fmt_mmm(s["seconds"][clock]["ours"]),
              C.fmt_mmm(s["time_ratio"][clock]), f"{1 / s['time_ratio'][clock]['median']:.3f}"] for clock in CLOCKS]
    verdicts = [f"- {what}: {value:.4f} (target <= {target:.4f}): {'met' if met else 'MISSED'}"
                for what, value, target, met in timing_verdicts(res)]
    return "\n".join([
        "# DiffusionNFT: the time split of an outer step (small benchmark model)",
        "", f"Machine: {C.machine_line(info)}; device {res['device']}, mixed precision {res['mixed_precision']}.", "",
        f"Command: `{command}`", "",
        f"{res['recipe']}'s transformer ({res['params']:,} parameters; latents {'x'.join(map(str, res['latent_shape']))}, "
        f"text {'x'.join(map(str, res['text_shape']))}), full fine-tuning (student, old policy and reference: three copies); "
        f"{res['samples_per_outer_step']} samples per outer step at {res['sampling_steps']} sampling steps, "
        f"{res['optimizer_steps_per_outer_step']} optimizer steps per outer step; reward `{res['reward']}`, decoded by the VAE "
        f"of {res['vae_from']}. Sampling, decoding, scoring and the sampling phase are the method's logged figures; training is "
        "the optimizer steps' step_time less their data_wait; the model-work columns are wall time inside those calls; the "
        "overhead is the wall time outside them.",
        "", C.markdown_table(header, rows), "",
        f"Sampling, {s['batch']} x {'x'.join(map(str, s['latent_shape']))} latents, {s['steps']} Euler steps: `sample_policy` "
        f"against a bare inference-mode loop on the same transformer, {s['rounds']} interleaved rounds of {s['reps']}; "
        f"largest difference between their samples {s['max_abs_diff']:.2e}.", "",
        C.markdown_table(["clock", "bare s/sampling", "ours s/sampling", "ours / bare (per round)", "speed ours / bare"], srows),
        "", *verdicts,
    ])


def print_verdicts(res: dict) -> bool:
    verdicts = timing_verdicts(res)
    for what, value, target, met in verdicts:
        print(f"{'MET   ' if met else 'MISSED'} {what}: {value:.4f} (target <= {target:.4f})")
    return all(met for *_, met in verdicts)


def run_distances(args: argparse.Namespace, scratch: Path) -> dict:
    """The finished run's final weights (ema/transformer where the run kept an EMA) against the
    teacher: distances to the nearest clip of the caption, held-out captions and every caption."""
    from fv_accel.tiny.modes import ClipModes

    weights = args.run / "ema" if (args.run / "ema" / "transformer").is_dir() else args.run
    over = {**student_overrides(args.student), "models.student.init_from": str(weights),
            "models.reference.init_from": args.student, "training.checkpoint.output_dir": str(scratch / "distances"),
            "training.tracker.trackers": ["none"]}
    from fv_accel.build import build_from_config

    run = quietly(build_from_config, NFT_RECIPE, over)
    method = run.method
    method._loader = run.dataloader
    modes = ClipModes.load(Path(run.dataloader.dataset.data_path).parent)
    out = {"run": shown(args.run), "weights": shown(weights), "heldout": list(args.heldout)}
    for key, captions in (("heldout_captions", list(args.heldout)), ("every_caption", modes.captions)):
        evaluator = at_seed(prompt_evaluator(run.config, method, run.dataloader, captions), args.val_seed)
        out[key] = distances(method, {"teacher": method.reference, "final": method.student}, evaluator, modes, args.val_videos)
    return out


def distances_markdown(res: dict, info: dict, command: str) -> str:
    rows = ["# The tiny NFT run's samples against the nearest clip of their caption", "",
            f"Command: `{command}`", "", f"Run: {res['run']} (weights {res['weights']}); held out: {res['heldout']}.", "",
            "| captions | model | latent distance (RMS) | track distance (px) | latent / teacher | track / teacher |",
            "|---|---|---|---|---|---|"]
    for key, label in (("heldout_captions", "held-out"), ("every_caption", "every caption")):
        t = res[key]["teacher"]
        for name, d in res[key].items():
            rows.append(f"| {label} | {name} | {d['latent']:.4f} | {d['track_px']:.2f} | {d['latent'] / t['latent']:.3f} | "
                        f"{d['track_px'] / t['track_px']:.3f} |")
    return "\n".join(rows) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    info = C.machine_info()
    command = C.command_line("nft.py", argv)
    date = time.strftime("%Y-%m-%d")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ok = True
    with contextlib.ExitStack() as stack:
        scratch = Path(tempfile.mkdtemp(dir=args.work_dir, prefix="nft-")) if args.keep else \
            Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.work_dir, prefix="nft-")))
        if args.curve:
            res = run_curve(args, scratch / "curve")
            payload = {**res, "machine": info, "command": command, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
            C.publish_results(args.out, f"{args.name}_curve_{date}", payload, curve_markdown(payload, info, command))
        if args.run is not None:
            res = run_distances(args, scratch / "distances")
            payload = {**res, "machine": info, "command": command}
            C.publish_results(args.out, f"{args.name}_distances_{date}", payload, distances_markdown(payload, info, command))
            C.reset_accelerate_state()
        if args.timing:
            if args.curve:
                C.reset_accelerate_state()
            res = run_timing(args, scratch / "timing")
            payload = {**res, "machine": info, "command": command, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
            C.publish_results(args.out, f"{args.name}_timing_{date}", payload, timing_markdown(payload, info, command))
            ok = print_verdicts(payload)
        if args.keep:
            print(f"scratch run folders kept in {scratch}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
