"""python -m fv_accel.generate: streaming a causal student chunk by chunk into a growing mp4."""

from __future__ import annotations

import argparse

import pytest
import torch

from fv_accel.generate import build_parser, generate, load, main, resolve_source
from fv_accel.rollout import causal_reference_sampler, iter_kv_cached_rollout, kv_cached_rollout

from conftest import REPO, tiny_overrides
from test_causal import inputs, make_student

CAUSAL_RECIPE = REPO / "configs" / "tiny_dfsft_causal.yaml"
PROMPT = "a red circle moving left on a blue background"
TRAINED_FRAMES = 21  # the tiny clips: 6 latent frames, 2 causal blocks of 3


def _train(folder, data_path, **extra):
    from fv_accel.build import build_from_config
    from fv_accel.trainer import Trainer

    overrides = tiny_overrides(
        folder,
        **{
            "training.loop.max_train_steps": 2,
            "training.data.data_path": data_path,
            "training.checkpoint.training_state_checkpointing_steps": 2,
            "training.checkpoint.save_final": True,
            **extra,
        },
    )
    Trainer(build_from_config(CAUSAL_RECIPE, overrides)).run()
    return folder / "out"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data_path):
    """A tiny causal DFSFT run (blocks of 3 latent frames) and a bidirectional one, 2 steps each."""
    causal = _train(tmp_path_factory.mktemp("causal_run"), tiny_data_path)
    bidir = _train(tmp_path_factory.mktemp("bidir_run"), tiny_data_path, **{"models.student.causal": False})
    return {"causal": str(causal), "bidirectional": str(bidir)}


def _args(run, output, *extra):
    return build_parser().parse_args([run, "--prompt", PROMPT, "--output", str(output), "--steps", "2", *extra])


def _frames(path) -> int:
    import av

    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


def test_iterated_rollout_chunks_are_the_one_shot_rollout():
    student = make_student(chunk=2)
    noise, _, tb = inputs(seed=5)
    negative = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(9))
    kwargs = dict(num_steps=3, shift=3.0, guidance_scale=3.0, negative_text=negative)
    chunks = list(iter_kv_cached_rollout(student, noise, tb.encoder_hidden_states, **kwargs))
    streamed = torch.cat([c.latents for c in chunks], dim=2)
    assert [(c.start, c.end) for c in chunks] == [(0, 2), (2, 4), (4, 6)]
    one_shot = kv_cached_rollout(student, noise, tb.encoder_hidden_states, **kwargs).latents
    reference = causal_reference_sampler(student, noise, tb.encoder_hidden_states, **kwargs).latents
    assert (streamed - one_shot).abs().max() < 1e-5
    assert (streamed - reference).abs().max() < 1e-5
    # An explicit sigma list equal to the sampling schedule steps exactly there.
    from fv_accel.sampling import sampling_sigmas

    sigmas = sampling_sigmas(3, 3.0)[0]
    explicit = kv_cached_rollout(student, noise, tb.encoder_hidden_states, sigmas=sigmas, **{**kwargs, "num_steps": 0})
    assert (explicit.latents - one_shot).abs().max() < 1e-6
    # Few-step re-noising (x0, then fresh noise to the next sigma) is a different, seeded sampler.
    few = [kv_cached_rollout(student, noise, tb.encoder_hidden_states, sigmas=[1.0, 0.5, 0.0], renoise=True,
                             generator=torch.Generator().manual_seed(1)).latents for _ in range(2)]
    assert torch.equal(few[0], few[1]) and (few[0] - one_shot).abs().max() > 1e-3


def test_wan_stream_decoder_pieces_equal_the_whole_decode(tiny_model_dir):
    from fv_accel.models import WanStudent
    from fv_accel.models.loading import load_vae

    vae = load_vae(str(tiny_model_dir)).eval()
    z = torch.randn(1, 16, 7, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = vae.decode(z, return_dict=False)[0]
        decoder = WanStudent.stream_decoder(vae)
        pieces = torch.cat([decoder.decode(z[:, :, a:b]) for a, b in ((0, 3), (3, 6), (6, 7))], dim=2)
    assert pieces.shape == whole.shape == (1, 3, 25, 32, 32)
    assert (pieces - whole).abs().max() < 1e-6


def test_causal_run_streams_chunks_into_a_growing_mp4(runs, tmp_path):
    out = tmp_path / "video.mp4"
    partial = tmp_path / "video.mp4.partial"
    sizes, chunks = [], []

    def on_chunk(index, chunk):
        sizes.append(partial.stat().st_size)
        chunks.append(chunk)

    report = generate(_args(runs["causal"], out, "--num_frames", "33", "--seed", "3"), on_chunk)
    assert report.chunks == 3 and len(sizes) == 3  # 9 latent frames, blocks of 3
    assert sizes[0] > 0 and sizes[0] < sizes[1] < sizes[2]  # the file grew after each chunk
    assert out.is_file() and not partial.exists()
    assert _frames(out) == 33 == report.frames

    # The streamed chunks are the one-shot rollout of the same seed.
    source = resolve_source(runs["causal"])
    loaded = load(source, PROMPT, "", torch.device("cpu"))
    noise = torch.randn(1, 16, 9, 6, 6, generator=torch.Generator().manual_seed(3))
    one_shot = kv_cached_rollout(
        loaded.student, noise, loaded.text.text, num_steps=2, shift=3.0, guidance_scale=5.0,
        negative_text=loaded.negative.text,
    ).latents
    assert (torch.cat([c.latents for c in chunks], dim=2) - one_shot).abs().max() < 1e-5


def test_kv_window_runs_past_the_trained_length_with_a_bounded_cache(runs, tmp_path):
    frames = 2 * (TRAINED_FRAMES - 1) + 1  # 41 frames, 11 latent frames: past the trained 6
    full = generate(_args(runs["causal"], tmp_path / "full.mp4", "--num_frames", str(frames)))
    windowed = generate(_args(runs["causal"], tmp_path / "window.mp4", "--num_frames", str(frames), "--kv_window", "6"))
    assert _frames(tmp_path / "window.mp4") == frames == windowed.frames
    assert full.cached_frames == [3, 6, 9, 9]  # every finished chunk stays (the last is not written)
    assert max(windowed.cached_frames) <= 6 and windowed.cached_frames == [3, 6, 6, 6]


@pytest.mark.parametrize(
    "which,extra,message",
    [
        ("causal", ["--num_frames", "44"], "--num_frames 44: the VAE makes 4k+1 frames; nearest valid counts: 41, 45"),
        ("causal", ["--num_frames", "129"], "--num_frames 129: 33 latent frames exceed the model's rotary table"),
        ("bidirectional", ["--num_frames", "21", "--kv_window", "6"], "--kv_window 6: the student is bidirectional"),
        ("causal", ["--num_frames", "21", "--kv_window", "4"], "--kv_window 4: must be a multiple of the causal block size 3"),
        ("causal", ["--num_frames", "21", "--image", "x.png"], "--image x.png: this student is text-to-video"),
        ("missing", ["--num_frames", "21"], "no such folder"),
    ],
)
def test_refusals_are_one_line_naming_the_value(runs, tmp_path, capsys, which, extra, message):
    run = runs.get(which, str(tmp_path / "no_run"))
    out = tmp_path / "x.mp4"
    assert main([run, "--prompt", PROMPT, "--output", str(out), "--steps", "1", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists() and not (tmp_path / "x.mp4.partial").exists()


def test_bidirectional_run_samples_the_whole_clip(runs, tmp_path):
    out = tmp_path / "bidir.mp4"
    report = generate(_args(runs["bidirectional"], out, "--num_frames", "17"))
    assert report.chunks == 1 and not report.streamed
    assert _frames(out) == 17


def test_help_names_the_partial_file():
    text = build_parser().format_help()
    assert ".partial" in text and "--kv_window" in text
    assert isinstance(build_parser().parse_args(["r", "--prompt", "p", "--num_frames", "5", "--output", "o.mp4"]), argparse.Namespace)


def test_a_self_forcing_run_streams_at_its_own_steps_past_its_trained_length(tmp_path, tiny_data_path):
    """A Self-Forcing run (its student_steps.json: 4 steps, x0 re-noised between them) streams at
    twice its trained length; the chunks equal the KV-cached rollout at those steps for the seed."""
    import json

    from fv_accel.build import build_from_config
    from fv_accel.trainer import Trainer
    from self_forcing_helpers import SF_RECIPE, self_forcing_overrides

    folder = tmp_path / "sf"
    Trainer(build_from_config(SF_RECIPE, self_forcing_overrides(folder, **{
        "training.loop.max_train_steps": 2, "training.data.data_path": tiny_data_path,
        "training.checkpoint.training_state_checkpointing_steps": 2, "training.checkpoint.save_final": True,
    }))).run()
    run = folder / "out"
    steps = json.loads((run / "student_steps.json").read_text())
    frames = 2 * (TRAINED_FRAMES - 1) + 1
    chunks = []
    args = build_parser().parse_args([str(run), "--prompt", PROMPT, "--output", str(tmp_path / "sf.mp4"),
                                      "--num_frames", str(frames), "--seed", "4"])
    report = generate(args, lambda index, chunk: chunks.append(chunk))
    assert report.chunks == 4 and _frames(tmp_path / "sf.mp4") == frames
    loaded = load(resolve_source(str(run)), PROMPT, "", torch.device("cpu"))
    noise = torch.randn(1, 16, 11, 6, 6, generator=torch.Generator().manual_seed(4))  # 41 frames: 11 latent
    one_shot = kv_cached_rollout(
        loaded.student, noise, loaded.text.text, sigmas=steps["sigmas"] + [0.0], timesteps=steps["timesteps"],
        renoise=True, generator=torch.Generator().manual_seed(5),  # generate's re-noising: seed + 1
    ).latents
    assert (torch.cat([c.latents for c in chunks], dim=2) - one_shot).abs().max() < 1e-5
