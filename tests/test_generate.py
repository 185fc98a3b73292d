"""python -m fv_accel.generate: streaming a causal student chunk by chunk into a growing mp4."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

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
        # Past the rotary table: the real limit, named once (not 4k+1 neighbours the table refuses next).
        ("causal", ["--num_frames", "100000"],
         "--num_frames 100000: past the model's rotary table (rope_max_seq_len 32: 32 latent frames); at most 125 frames"),
        ("causal", ["--num_frames", "129"], "--num_frames 129: past the model's rotary table"),
        ("causal", ["--num_frames", "21", "--height", "48", "--width", "640"],
         "--height 48 / --width 640: past the model's rotary table (rope_max_seq_len 32: 32 positions per axis); "
         "at most 512 px high and 512 px wide: give --height and --width"),
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


def test_a_tiny_model_folder_without_a_size_is_refused_in_one_line_naming_the_default(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "m.mp4"
    assert main([str(tiny_model_dir), "--prompt", PROMPT, "--output", str(out), "--steps", "1", "--num_frames", "9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --height 480 / --width 832 (the 480p default: the source records no size): past the model's "
                   "rotary table (rope_max_seq_len 32: 32 positions per axis); at most 512 px high and 512 px wide: "
                   "give --height and --width"], err
    assert not out.exists()
    assert main([str(tiny_model_dir), "--prompt", PROMPT, "--output", str(out), "--steps", "1", "--num_frames", "9",
                 "--height", "48", "--width", "48"]) == 0
    assert _frames(out) == 9


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


# ---- runs as a user has them: a LoRA run, a run in progress, an LTX-2 run; the output file; Ctrl-C ----


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_data_path, tiny_model_dir):
    """A causal DFSFT LoRA run on the tiny Wan model folder, 2 steps."""
    return _train(tmp_path_factory.mktemp("lora_run"), tiny_data_path, **{
        "models.student.init_from": str(tiny_model_dir), "models.student.lora.enable": True,
        "models.student.lora.rank": 4,
    })


def _chunk_latents(run, output, *extra) -> torch.Tensor:
    chunks = []
    generate(_args(str(run), output, "--num_frames", "21", "--seed", "2", *extra), lambda index, chunk: chunks.append(chunk.latents))
    return torch.cat(chunks, dim=2)


def test_a_lora_run_generates_from_its_base_and_adapter_as_its_merged_export(lora_run, tmp_path):
    """`generate RUN` on a LoRA run: the recipe's base with the run's adapter (the file's tensors,
    trained away from zero); the same video as `generate` on its `export --to merged` folder."""
    from safetensors.torch import load_file

    from fv_accel.export import export
    from fv_accel.models.lora import DIFFUSERS_LORA_FILE, adapter_state_dict

    direct = _chunk_latents(lora_run, tmp_path / "lora.mp4")
    assert _frames(tmp_path / "lora.mp4") == 21
    loaded = load(resolve_source(str(lora_run)), PROMPT, "", torch.device("cpu"))
    saved = load_file(str(lora_run / DIFFUSERS_LORA_FILE))
    adapter = adapter_state_dict(loaded.student.transformer)
    assert len(adapter) > 0 and {f"transformer.{k}" for k in adapter} == set(saved)
    assert all(torch.equal(v, saved[f"transformer.{k}"]) for k, v in adapter.items())
    assert max(float(v.abs().max()) for k, v in adapter.items() if ".lora_B." in k) > 0  # trained, not the zero init
    (transformer,) = export(lora_run, "merged")
    merged = _chunk_latents(transformer.parent, tmp_path / "merged.mp4")
    assert transformer.parent == lora_run / "exports" / "final_merged"
    assert (direct - merged).abs().max() < 1e-4


def test_a_run_in_progress_names_the_export_of_its_checkpoint_which_generates(runs, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file

    from fv_accel.export import main as export_main

    run = tmp_path / "in_progress"
    shutil.copytree(f"{runs['causal']}/checkpoint-2", run / "checkpoint-2")  # no final weights yet
    out = tmp_path / "x.mp4"
    assert main([str(run), "--prompt", PROMPT, "--output", str(out), "--num_frames", "21"]) == 2
    ckpt, export_dir = run / "checkpoint-2", run / "exports" / "checkpoint-2_diffusers"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {run}: no final weights yet (the run is still training or stopped before its end); its latest checkpoint: "
        f"export it with `python -m fv_accel.export {ckpt} --to diffusers` and generate from {export_dir}"
    ]
    export_main([str(ckpt), "--to", "diffusers"])
    # The export of step 2 (the run's last) holds the finished run's weights, and generates.
    exported, final = (load_file(str(d / "transformer" / "diffusion_pytorch_model.safetensors")) for d in (export_dir, Path(runs["causal"])))
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    report = generate(_args(str(export_dir), out, "--num_frames", "9"))
    assert report.chunks == 1 and _frames(out) == 9


def test_an_existing_output_is_refused_and_ctrl_c_is_one_line_leaving_it(runs, tmp_path, monkeypatch, capsys):
    import fv_accel.generate as module

    out = tmp_path / "kept.mp4"
    out.write_bytes(b"an earlier video")
    argv = [runs["causal"], "--prompt", PROMPT, "--output", str(out), "--num_frames", "9", "--steps", "1"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --output {out}: the file exists; give another path, or add --overwrite to replace it"
    ]
    original = module.stream_causal

    def interrupted(loaded, settings, noise, writer, generator, on_chunk=None):
        def ctrl_c(index, chunk):
            raise KeyboardInterrupt

        return original(loaded, settings, noise, writer, generator, ctrl_c)

    monkeypatch.setattr(module, "stream_causal", interrupted)
    assert main([*argv, "--overwrite"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line for line in err.splitlines() if "interrupted" in line] == [
        f"interrupted: {out} left unchanged"
    ]
    assert out.read_bytes() == b"an earlier video" and not (tmp_path / "kept.mp4.partial").exists()
    monkeypatch.setattr(module, "stream_causal", original)
    assert main([*argv, "--overwrite"]) == 0 and _frames(out) == 9


def test_an_ltx2_run_at_its_own_text_length_generates_video_with_its_sound(tmp_path, tiny_model_of):
    """A full LTX-2 run trained at text_max_length 64 (its tokenizer's length, not 1024): generate
    builds it on the base it was trained from and writes the video with the sound made with it."""
    import av

    from family_helpers import preprocess_sound_clips, run_overrides
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    model = tiny_model_of("ltx2")
    assert preprocess_sound_clips(model, tmp_path).encoded == 3
    Trainer(build_from_config(default_recipe("finetune"), run_overrides(tmp_path, model, tmp_path / "data", **{
        "training.data.text_max_length": 64, "training.loop.max_train_steps": 1,
        "training.checkpoint.training_state_checkpointing_steps": 1,
    }))).run()
    out = tmp_path / "ltx2.mp4"
    report = generate(build_parser().parse_args([
        str(tmp_path / "out"), "--prompt", "a red ball", "--output", str(out), "--num_frames", "9", "--steps", "2"]))
    assert report.sound and report.frames == 9
    with av.open(str(out)) as container:
        picture, sound = container.streams.video[0], container.streams.audio[0]
        seconds = [float(s.duration * s.time_base) for s in (picture, sound)]
        assert sound.codec_context.name == "aac" and sound.codec_context.channels == 2
    assert seconds[0] == pytest.approx(9 / 24, abs=1e-3)  # at LTX-2's frame rate, the sound's
    assert seconds[1] == pytest.approx(seconds[0], abs=0.05)


# ---- model cards: every snippet runs as written ----


@pytest.fixture(scope="module")
def dmd2_run(tmp_path_factory):
    """A tiny DMD2 run whose teacher is built from an inline transformer_config on the tiny world,
    with one sample video at its end (its card's sampling size)."""
    from dmd2_helpers import DMD2_RECIPE, dmd2_overrides
    from fv_accel.build import build_from_config
    from fv_accel.trainer import Trainer

    folder = tmp_path_factory.mktemp("dmd2_run")
    run = build_from_config(DMD2_RECIPE, dmd2_overrides(folder, **{
        "training.loop.max_train_steps": 2, "callbacks.validation.enable": True, "callbacks.validation.every_steps": 2,
        "callbacks.validation.prompts": [PROMPT], "callbacks.validation.sampling_steps": 2,
    }))
    Trainer(run).run()
    return folder / "out", run.dataloader.dataset.data_path


def run_card_snippets(card) -> dict:
    """Every ```python block of a model card, run in order in one namespace, as a user pastes them."""
    import re

    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", card.read_text(), flags=re.S):
        exec(compile(block, str(card), "exec"), namespace)
    return namespace


def test_every_model_card_snippet_runs_as_written(runs, lora_run, dmd2_run):
    """Offline, on tiny runs: the cards of a DMD2 student (teacher built inline on the tiny world), a
    LoRA run and a full run load the pipeline the run's components came from, and the DMD2 card's
    few-step call samples its 2-step student at the size of its samples."""
    import numpy as np
    from diffusers import FlowMatchLCMScheduler, WanPipeline

    from fv_accel.data.schema import read_dataset_info

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    dmd2, data_path = dmd2_run
    card = (dmd2 / "README.md").read_text()
    tiny_world = read_dataset_info(data_path)["model"]  # the tiny model folder validation sampled with
    assert f'WanPipeline.from_pretrained("{tiny_world}", transformer=transformer' in card
    ran = run_card_snippets(dmd2 / "README.md")
    assert type(ran["pipe"]) is WanPipeline and type(ran["pipe"].scheduler) is FlowMatchLCMScheduler
    video = np.asarray(ran["video"])
    assert video.shape == (21, 48, 48, 3) and np.isfinite(video).all() and video.std() > 0
    ran = run_card_snippets(lora_run / "README.md")
    assert ran["pipe"].transformer.peft_config  # the run's adapter, on the base it was trained on
    ran = run_card_snippets(Path(runs["bidirectional"]) / "README.md")
    trained, used = ran["transformer"].state_dict(), ran["pipe"].transformer.state_dict()
    assert trained.keys() == used.keys() and all(torch.equal(trained[k], used[k]) for k in trained)
