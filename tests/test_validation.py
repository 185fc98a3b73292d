"""Validation: sample videos (WanPipeline for SFT, diffusion forcing for DFSFT), held-out loss by
noise level, and the guarantee that neither changes training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_overrides
from tests.launch_helpers import ANY_FREE_PORT

PROMPT = "a white square moving up on a light background"


def validation_overrides(tmp_path, **extra):
    """Validation at step 2 of a 2-step run: one small video per prompt, 2 held-out clips."""
    return tiny_overrides(
        tmp_path,
        **{
            "callbacks.validation.enable": True,
            "callbacks.validation.every_steps": 2,
            "callbacks.validation.at_start": False,
            "callbacks.validation.prompts": [PROMPT],
            "callbacks.validation.sampling_steps": 2,
            "callbacks.validation.guidance_scale": 2.0,
            "callbacks.validation.height": 32,
            "callbacks.validation.width": 32,
            "callbacks.validation.num_frames": 9,
            "callbacks.validation.heldout_data_path": None,
            "callbacks.validation.heldout_fraction": 0.25,
            "callbacks.validation.heldout_max_samples": 2,
            "callbacks.validation.distance_clips": 0,
            "training.loop.max_train_steps": 2,
            "training.checkpoint.save_final": False,
            **extra,
        },
    )


def build(method: str, overrides: dict, callbacks=None):
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe

    return build_from_config(default_recipe(method), overrides, callbacks=callbacks)


def callback_of(run, cls):
    found = [cb for cb in run.callbacks if isinstance(cb, cls)]
    assert len(found) == 1, run.callbacks
    return found[0]


def decode_mp4(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def tensorboard_events(logdir: Path) -> tuple[dict, set]:
    """(scalar tag -> {step: value}, image tags) of every event file under logdir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict = {}
    images: set = set()
    files = sorted(logdir.rglob("events.out.tfevents*"))
    assert files, f"no TensorBoard event files under {logdir}"
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0, "images": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
        images |= set(acc.Tags()["images"])
    return scalars, images


def metrics_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------
# Whole runs
# --------------------------------------------------------------------------------------------


def test_sft_run_writes_videos_tensorboard_scalars_and_plots(tmp_path, capsys):
    from fv_accel.trainer import Trainer

    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(
        json.dumps({"prompt": "a red circle moving left on a dark background", "frames": 5, "height": 16,
                    "width": 48, "steps": 3, "seed": 7, "name": "wide"}) + "\n"
    )
    over = validation_overrides(
        tmp_path,
        **{
            "callbacks.validation.prompt_file": str(prompt_file),
            "training.tracker.trackers": ["tensorboard"],
            "training.tracker.write_plots": True,
        },
    )
    run = build("finetune", over)
    summary = Trainer(run).run()
    out = tmp_path / "out"

    step_dir = out / "samples" / "step-2"
    videos = sorted(p.name for p in step_dir.glob("*.mp4"))
    assert videos == ["00-a-white-square-moving-up-on-a-light-back.mp4", "wide.mp4"]
    first = decode_mp4(step_dir / videos[0])
    wide = decode_mp4(step_dir / "wide.mp4")
    assert first.shape == (9, 32, 32, 3)  # frames, height, width from callbacks.validation.*
    assert wide.shape == (5, 16, 48, 3)  # per-prompt frames/height/width from the prompt file
    assert first.std() > 0  # a decoded picture, not a constant frame

    scalars, images = tensorboard_events(out / "logs")
    assert set(scalars["loss"]) == {1, 2}
    for key in ("heldout/loss", "heldout/sigma_0.10", "heldout/sigma_0.90", "cpu_rss_gb", "samples_per_s"):
        assert key in scalars, key
    assert set(scalars["heldout/loss"]) == {2}
    assert {"validation/wide", "validation/00-a-white-square-moving-up-on-a-light-back"} <= images
    assert {"plots/heldout_loss", "plots/loss", "plots/throughput"} <= images  # the end-of-run plots

    rows = metrics_rows(out)
    heldout = [r for r in rows if "heldout/loss" in r]
    assert [r["step"] for r in heldout] == [2]
    buckets = [heldout[0][f"heldout/sigma_{s:.2f}"] for s in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert heldout[0]["heldout/loss"] == pytest.approx(np.mean(buckets), rel=1e-12)
    assert scalars["heldout/loss"][2] == pytest.approx(heldout[0]["heldout/loss"], rel=1e-6)
    assert all(r["cpu_rss_gb"] > 0.05 for r in rows if "loss" in r)
    assert summary["best_heldout_loss"] == heldout[0]["heldout/loss"] and summary["best_heldout_step"] == 2
    saved = json.loads((out / "logs" / "summary.json").read_text())
    assert saved["best_heldout_loss"] == summary["best_heldout_loss"]
    plots = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert plots == ["heldout_loss.png", "loss.png", "throughput.png"]
    # stderr is no terminal here: the held-out evaluation draws no bar (its result is a log line) and
    # the training's progress is plain lines. Then the model card.
    err = capsys.readouterr().err
    assert "held-out" not in err and "\r" not in err and "train: 2/2 step (100%)" in err, err
    card = (out / "README.md").read_text()
    assert "![Held-out loss](plots/heldout_loss.png)" in card and '<video src="samples/step-2/wide.mp4"' in card
    assert "(6 training clips)" in card  # the tiny dataset's 8 less the 2 held out


def test_dfsft_run_samples_chunk_by_chunk(tmp_path):
    from fv_accel.sampling import num_rounds
    from fv_accel.trainer import Trainer

    over = validation_overrides(
        tmp_path,
        **{
            # The training clips' size (21 frames of 48x48, the tiny data's): 6 latent frames ->
            # chunks [0, 3) and [3, 6).
            "callbacks.validation.num_frames": None,
            "callbacks.validation.height": None,
            "callbacks.validation.width": None,
            "callbacks.validation.ar_step": None,
            "callbacks.validation.context_noise": 0.05,
            "callbacks.ema.enable": True,
            "callbacks.ema.decay": 0.5,
            "callbacks.validation.at_start": True,
            "callbacks.validation.distance_clips": 2,
        },
    )
    run = build("dfsft", over)
    student = run.method.student
    calls = []
    original = student.forward  # every model call (training, held-out loss, sampling) goes through it

    def counting(x, t, cond):
        calls.append(tuple(t.shape))
        return original(x, t, cond)

    student.forward = counting
    summary = Trainer(run).run()

    video = decode_mp4(tmp_path / "out" / "samples" / "step-2" / "00-a-white-square-moving-up-on-a-light-back.mp4")
    assert video.shape == (21, 48, 48, 3)
    # 2 training steps; held-out at the start and at step 2: 2 clips x (5 buckets + 2 chunk
    # patterns); sampling at both: chunk by chunk 2 steps per chunk, 2 chunks -> 4 rounds, twice
    # each for guidance.
    rounds = num_rounds(6, 3, 2, None)
    assert rounds == 4
    assert len(calls) == 2 + 2 * (2 * 7 + 2 * rounds)
    assert all(len(shape) == 2 for shape in calls)  # per-frame timesteps everywhere in DFSFT
    row = [r for r in metrics_rows(tmp_path / "out") if "heldout/loss" in r][0]
    assert {"heldout/chunks_ramp_up", "heldout/chunks_ramp_down"} <= set(row)
    assert row["heldout/chunks_ramp_up"] != row["heldout/chunks_ramp_down"]
    # The sample grid: a row per prompt (one), a column per validation (steps 0 and 2), each cell a
    # strip of 5 frames of 48x48 under a header row.
    from PIL import Image

    from fv_accel.validation import _GRID_GAP, _GRID_HEADER, GRID_FRAMES

    with Image.open(tmp_path / "out" / "samples" / "grid.png") as grid:
        cell_w = GRID_FRAMES * 49 - 1
        assert grid.size == (2 * cell_w + 3 * _GRID_GAP, _GRID_HEADER + 48 + _GRID_GAP)
        pixels = np.asarray(grid.convert("RGB")).astype(int)
    last = pixels[_GRID_HEADER : _GRID_HEADER + 48, 2 * _GRID_GAP + cell_w :][:, :cell_w]
    # The last column is the last step's video: its first and last frames (the mp4 is lossy: the
    # tiny VAE's decoder draws high-frequency patterns; a blank or another picture is ~100 away).
    assert np.abs(last[:, :48] - video[0]).mean() < 16 and np.abs(last[:, -48:] - video[-1]).mean() < 16
    # The distance of the samples to the nearest of 2 training clips (decoded by the same VAE),
    # at both validations, and first and last in the summary.
    rows = [r for r in metrics_rows(tmp_path / "out") if "samples/distance" in r]
    assert [r["step"] for r in rows] == [0, 2]
    name = "00-a-white-square-moving-up-on-a-light-back"
    for key in ("samples/distance", "samples/latent_distance"):
        assert all(r[key] == r[f"{key}/{name}"] > 0 for r in rows)
    assert summary["first_sample_distance"] == rows[0]["samples/distance"]
    assert summary["last_sample_distance"] == rows[1]["samples/distance"]
    assert summary["last_sample_latent_distance"] == rows[1]["samples/latent_distance"]
    # The references: the first 2 training clips, decoded at the training clips' size.
    from fv_accel.validation import VideoSamplingCallback

    references = callback_of(run, VideoSamplingCallback).references
    assert [f.shape for _, f in references] == [(21, 48, 48, 3)] * 2


def test_validation_does_not_change_training(tmp_path):
    """Same weights, same method generator, same global RNG state with and without validation
    (held-out loss, EMA-swapped sampling at the start and after every step)."""
    from fv_accel.trainer import Trainer

    def train(tag: str, with_validation: bool):
        over = validation_overrides(
            tmp_path / tag,
            **{
                "training.loop.max_train_steps": 3,
                "callbacks.validation.enable": with_validation,
                "callbacks.validation.every_steps": 1,
                "callbacks.validation.at_start": True,
                "callbacks.validation.num_frames": 5,
                "callbacks.ema.enable": with_validation,
                "callbacks.ema.decay": 0.5,
            },
        )
        run = build("dfsft", over)
        Trainer(run).run()
        model = run.accelerator.unwrap_model(run.method.student.transformer)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        gen = run.method.cuda_generator.get_state().clone()
        rng = torch.get_rng_state().clone()
        samples = sorted((tmp_path / tag / "out" / "samples").glob("step-*/*.mp4"))
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        return state, gen, rng, samples

    with_state, with_gen, with_rng, with_samples = train("with", True)
    without_state, without_gen, without_rng, without_samples = train("without", False)
    assert len(with_samples) == 4 and not without_samples  # steps 0, 1, 2, 3
    assert with_state.keys() == without_state.keys()
    for name in with_state:
        assert torch.equal(with_state[name], without_state[name]), name
    assert torch.equal(with_gen, without_gen)
    assert torch.equal(with_rng, without_rng)


def test_heldout_loss_is_identical_when_evaluated_twice(tmp_path):
    from fv_accel.trainer import Trainer
    from fv_accel.validation import HeldoutLossCallback

    run = build("dfsft", validation_overrides(tmp_path, **{"callbacks.validation.prompts": []}))
    heldout = callback_of(run, HeldoutLossCallback)
    assert heldout.rows == [0, 7]  # the fixed split of the tiny data (seed 0)
    trainer = Trainer(run)
    gen_before = run.method.cuda_generator.get_state().clone()
    rng_before = torch.get_rng_state().clone()
    first = heldout.evaluate(trainer)
    second = heldout.evaluate(trainer)
    assert first == second  # bit for bit
    assert torch.equal(run.method.cuda_generator.get_state(), gen_before)
    assert torch.equal(torch.get_rng_state(), rng_before)
    buckets = [f"heldout/sigma_{s:.2f}" for s in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert set(first) == set(buckets) | {"heldout/loss", "heldout/chunks_ramp_up", "heldout/chunks_ramp_down"}
    assert first["heldout/loss"] == pytest.approx(np.mean([first[k] for k in buckets]), rel=1e-12)
    assert all(np.isfinite(v) and v > 0 for v in first.values())
    assert len({round(first[k], 6) for k in buckets}) == len(buckets)  # the buckets are distinct measurements

    Trainer(run).run()  # two optimizer steps (the first at warm-up lr 0), then the step-2 evaluation
    after = heldout.evaluate(trainer)
    assert after == heldout.evaluate(trainer)
    assert after["heldout/loss"] != first["heldout/loss"]
    assert heldout.last == (after["heldout/loss"], 2)  # what the run logged at its end


def test_heldout_rows_are_never_trained_on(tmp_path, tiny_data_path):
    from fv_accel.validation import heldout_split

    run = build("finetune", validation_overrides(tmp_path, **{"callbacks.validation.enable": False}))
    assert run.callbacks == []  # validation off: no callbacks, but the split is still carved out
    sampler = run.dataloader.sampler
    seen = set()
    for epoch in range(3):
        for group in sampler.epoch_groups(epoch):
            seen |= set(group)
    assert heldout_split(8, 0.25, 0) == [0, 7]
    assert seen == {1, 2, 3, 4, 5, 6}
    # Another seed holds out other rows; a fraction of 0 holds out nothing.
    assert heldout_split(8, 0.25, 1) != [0, 7] and heldout_split(8, 0.0, 0) == []
    with pytest.raises(ValueError, match="heldout_fraction"):
        heldout_split(2, 0.9, 0)


def test_heldout_fraction_and_path_are_exclusive():
    from fv_accel.config import ConfigError, default_recipe, load_config

    with pytest.raises(ConfigError, match="callbacks.validation.heldout_fraction"):
        load_config(default_recipe("finetune"), {"callbacks.validation.heldout_fraction": 0.2})  # recipe sets a path
    with pytest.raises(ConfigError, match="callbacks.validation.num_frames"):
        load_config(default_recipe("finetune"), {"callbacks.validation.num_frames": 8})


# --------------------------------------------------------------------------------------------
# Samplers
# --------------------------------------------------------------------------------------------


def test_diffusion_forcing_schedule():
    from fv_accel.sampling import chunk_bounds, diffusion_forcing_schedule

    # Chunk by chunk: chunk k starts when chunk k-1 has taken all 2 steps.
    assert diffusion_forcing_schedule(3, 2, None).tolist() == [
        [0, -2, -4], [1, -1, -3], [2, 0, -2], [3, 1, -1], [4, 2, 0], [5, 3, 1]
    ]
    # ar_step 1: each chunk one step behind the previous one.
    assert diffusion_forcing_schedule(3, 2, 1).tolist() == [[0, -1, -2], [1, 0, -1], [2, 1, 0], [3, 2, 1]]
    # ar_step 0: all chunks together (ordinary sampling).
    assert diffusion_forcing_schedule(3, 2, 0).tolist() == [[0, 0, 0], [1, 1, 1]]
    assert chunk_bounds(7, 3) == [(0, 3), (3, 6), (6, 7)]


def tiny_vae(tiny_data_path):
    from diffusers import AutoencoderKLWan

    from fv_accel.data.schema import read_dataset_info

    return AutoencoderKLWan.from_pretrained(read_dataset_info(tiny_data_path)["model"], subfolder="vae").eval()


def test_df_sampler_with_one_chunk_equals_wan_pipeline(tiny_data_path):
    """All chunks together = the stock WanPipeline: the per-frame Euler update is the scheduler's."""
    from diffusers import WanTransformer3DModel

    from fv_accel.config import default_recipe, load_config
    from fv_accel.sampling import sample_diffusion_forcing, sample_wan_pipeline, sampling_scheduler

    torch.manual_seed(0)
    cfg = load_config(default_recipe("finetune"))
    transformer = WanTransformer3DModel(**cfg.models.student.transformer_config).eval()
    g = torch.Generator().manual_seed(3)
    text, negative = torch.randn(1, 512, 32, generator=g), torch.randn(1, 512, 32, generator=g)
    # The pipeline's start noise: randn of the latent shape from the generator it is given.
    noise = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(11))

    def predict(x, t, emb):
        # Wan takes per-token timesteps: 2x2 tokens per latent frame of 4x4.
        return transformer(hidden_states=x, timestep=t.repeat_interleave(4, dim=1), encoder_hidden_states=emb,
                           return_dict=False)[0]

    with torch.no_grad():
        ours = sample_diffusion_forcing(predict, noise, text, chunk_size=3, num_inference_steps=4, shift=5.0,
                                        guidance_scale=3.0, negative_text=negative, ar_step=0)
        stock = sample_wan_pipeline(transformer, tiny_vae(tiny_data_path), text, negative_prompt_embeds=negative,
                                    height=32, width=32, num_frames=9, num_inference_steps=4, guidance_scale=3.0,
                                    scheduler=sampling_scheduler(5.0), generator=torch.Generator().manual_seed(11))
    assert stock.shape == ours.shape == (1, 16, 3, 4, 4)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)
    assert (ours - noise).abs().mean() > 0.1  # it did denoise


@pytest.mark.parametrize("ar_step", [None, 1])
def test_df_sampler_causal_student_first_chunk_ignores_later_noise(ar_step):
    """A block-causal student (models.student.causal, fv_accel/models/attention.py): the first
    chunks' output does not depend on the last chunk's noise; a bidirectional one's does."""
    from fv_accel.config import default_recipe, load_config
    from fv_accel.models import build_student
    from fv_accel.models.base import TrainingBatch
    from fv_accel.sampling import sample_diffusion_forcing

    g = torch.Generator().manual_seed(0)
    text = torch.randn(1, 512, 32, generator=g)
    noise = torch.randn(1, 16, 6, 4, 4, generator=g)
    changed = noise.clone()
    changed[:, :, 4:] = torch.randn(1, 16, 2, 4, 4, generator=g)  # the last chunk of [0,2) [2,4) [4,6)

    def first_chunks_change(causal: bool) -> tuple[float, float]:
        """Max change of the first two chunks' and of the last chunk's output."""
        cfg = load_config(default_recipe("dfsft"), {
            "models.student.causal": causal, "method.chunk_size": 2, "models.student.causal_attention_backend": "chunked"
        })
        torch.manual_seed(0)
        student = build_student(cfg)
        student.transformer.eval()

        def predict(x, t, emb):
            return student.predict_noise(x, t, TrainingBatch(encoder_hidden_states=emb))

        kw = dict(chunk_size=2, num_inference_steps=3, shift=3.0, guidance_scale=2.0,
                  negative_text=torch.zeros_like(text), ar_step=ar_step, context_noise=0.1)
        with torch.no_grad():
            a = sample_diffusion_forcing(predict, noise, text, generator=torch.Generator().manual_seed(5), **kw)
            b = sample_diffusion_forcing(predict, changed, text, generator=torch.Generator().manual_seed(5), **kw)
            if causal:
                # The sampler's shortcut for causal students (frames after the last started chunk
                # are left out of each call) changes nothing.
                short = sample_diffusion_forcing(
                    predict, noise, text, generator=torch.Generator().manual_seed(5), causal=True, **kw
                )
                torch.testing.assert_close(short, a, atol=1e-5, rtol=1e-5)
        return float((a - b)[:, :, :4].abs().max()), float((a - b)[:, :, 4:].abs().max())

    causal_first, causal_last = first_chunks_change(True)
    assert causal_first == 0.0 and causal_last > 0.1
    bidirectional_first, _ = first_chunks_change(False)
    assert bidirectional_first > 1e-4  # the test can tell the difference


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------

DEFAULTS = dict(negative_prompt="", height=32, width=48, num_frames=9, sampling_steps=4, guidance_scale=5.0, seed=100)


def test_prompt_files_txt_jsonl_json(tmp_path):
    from fv_accel.validation import read_prompt_file, resolve_prompts

    txt = tmp_path / "p.txt"
    txt.write_text("# comment\na red circle\n\n a blue square \n")
    assert read_prompt_file(txt) == ["a red circle", "a blue square"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('"plain"\n{"prompt": "custom", "height": 64, "width": 16, "frames": 5, "steps": 2, '
                     '"guidance": 1.5, "seed": 3, "negative_prompt": "blurry"}\n')
    js = tmp_path / "p.json"
    js.write_text(json.dumps({"prompts": ["x", {"prompt": "y", "name": "Why Not"}]}))
    assert read_prompt_file(js) == ["x", {"prompt": "y", "name": "Why Not"}]

    plain, custom = resolve_prompts(read_prompt_file(jsonl), DEFAULTS, "test")
    assert (plain.height, plain.width, plain.num_frames, plain.sampling_steps, plain.guidance_scale, plain.seed) == (
        32, 48, 9, 4, 5.0, 100
    )
    assert (custom.height, custom.width, custom.num_frames, custom.sampling_steps, custom.guidance_scale,
            custom.seed, custom.negative_prompt) == (64, 16, 5, 2, 1.5, 3, "blurry")
    assert plain.name == "00-plain"
    assert [p.seed for p in resolve_prompts(["a", "b", "c"], DEFAULTS, "t")] == [100, 101, 102]
    assert resolve_prompts(read_prompt_file(js), DEFAULTS, "t")[1].name == "why-not"


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"prompt": "a", "fps": 3}, "unknown key 'fps'"),
        ({"prompt": "a", "frames": 8}, "4k\\+1"),
        ({"prompt": "a", "height": 20}, "multiples of 16"),
        ({"prompt": "a", "steps": 2, "sampling_steps": 3}, "second time"),
        ({"height": 32}, "non-empty 'prompt'"),
        ({"prompt": "a", "seed": 1.5}, "'seed' must be an integer"),
    ],
)
def test_bad_prompts_are_named(entry, message):
    from fv_accel.validation import resolve_prompts

    with pytest.raises(ValueError, match=message) as err:
        resolve_prompts([entry], DEFAULTS, "prompts.jsonl")
    assert "prompts.jsonl[0]" in str(err.value)


def test_bad_prompt_file_lines_are_named(tmp_path):
    from fv_accel.validation import read_prompt_file

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match="bad.jsonl: line 2"):
        read_prompt_file(bad)
    with pytest.raises(ValueError, match="unknown prompt file type '.csv'"):
        (tmp_path / "p.csv").write_text("a\n")
        read_prompt_file(tmp_path / "p.csv")
    with pytest.raises(FileNotFoundError, match="callbacks.validation.prompt_file"):
        read_prompt_file(tmp_path / "missing.txt")


# --------------------------------------------------------------------------------------------
# Two processes
# --------------------------------------------------------------------------------------------

DRIVER = '''
import json, sys
from fv_accel.build import build_from_config
from fv_accel.config import default_recipe
from fv_accel.trainer import Trainer
from fv_accel.validation import HeldoutLossCallback

overrides, record = json.loads(sys.argv[1]), sys.argv[2]
run = build_from_config(default_recipe("dfsft"), overrides)
heldout = [cb for cb in run.callbacks if isinstance(cb, HeldoutLossCallback)][0]
trainer = Trainer(run)
step0 = heldout.evaluate(trainer)
Trainer(run).run()
acc = run.accelerator
with open(f"{record}.rank{acc.process_index}.json", "w") as fh:
    json.dump({"rank": acc.process_index, "world_size": acc.num_processes, "step0": step0}, fh)
'''


@pytest.mark.multiproc
def test_two_processes_split_the_heldout_set_and_sample_on_rank_zero(tmp_path):
    """3 held-out clips over 2 ranks (one rank pads) give the 1-process numbers; the main process
    alone samples the videos while the other waits."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    from fv_accel.trainer import Trainer
    from fv_accel.validation import HeldoutLossCallback

    over = validation_overrides(
        tmp_path / "two",
        **{"training.data.train_batch_size": 1, "callbacks.validation.heldout_max_samples": 3,
           "callbacks.validation.heldout_fraction": 0.4, "callbacks.validation.num_frames": 5},
    )
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    accelerate = Path(sys.executable).parent / "accelerate"
    proc = subprocess.run(
        [str(accelerate), "launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_2proc.yaml"),
         "--num_processes", "2", *ANY_FREE_PORT, str(driver), json.dumps(over), str(tmp_path / "record")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = [json.loads((tmp_path / f"record.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in records] == [2, 2] and [r["rank"] for r in records] == [0, 1]
    assert records[0]["step0"] == records[1]["step0"]  # reduced: the same numbers on both ranks
    videos = sorted((tmp_path / "two" / "out" / "samples" / "step-2").glob("*.mp4"))
    assert [v.name for v in videos] == ["00-a-white-square-moving-up-on-a-light-back.mp4"]

    run = build("dfsft", validation_overrides(tmp_path / "one", **over_one(over)))
    heldout = callback_of(run, HeldoutLossCallback)
    assert len(heldout.rows) == 3
    one = heldout.evaluate(Trainer(run))
    assert one.keys() == records[0]["step0"].keys()
    for key, value in one.items():
        assert records[0]["step0"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def over_one(over: dict) -> dict:
    """The two-process overrides for an in-process single-process build (own output folder)."""
    return {k: v for k, v in over.items() if k != "training.checkpoint.output_dir"}


def test_initial_weights_do_not_depend_on_the_dataset_cache(tmp_path):
    """A first run builds the tiny dataset (which reseeds the global RNG) and a second finds it
    cached: both start from the same weights, so their held-out curves are comparable."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    over = tiny_overrides(
        tmp_path,
        **{
            "training.data.tiny_cache_dir": str(tmp_path / "cache"),
            "training.data.tiny_num_clips": 2,
            "training.data.tiny_num_frames": 5,
            "training.data.tiny_height": 16,
            "training.data.tiny_width": 16,
            "training.data.train_batch_size": 1,
            "method.chunk_size": 1,
        },
    )
    states = []
    for _ in range(2):
        run = build("dfsft", over)
        model = run.accelerator.unwrap_model(run.method.student.transformer)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
