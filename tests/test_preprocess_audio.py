"""Sound in preprocessing (LTX-2): each clip's audio track decoded with PyAV over the time its sampled
picture spans, resampled to the audio VAE's rate, turned into LTX-2's log-mel spectrogram and encoded
by the tiny LTX-2's audio VAE into `audio_latent` beside the video latents; a clip without sound and
a clip whose sound is shorter than its picture are reported; the stored sound trains the audio
branch through the audio loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from family_helpers import preprocess_sound_clips, run_overrides

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sound_data(tmp_path_factory, tiny_model_of):
    """The tiny LTX-2, its three sound clips (tone, silent, short) and their preprocessing."""
    model = tiny_model_of("ltx2")
    root = tmp_path_factory.mktemp("ltx2_sound")
    return model, root, preprocess_sound_clips(model, root)


def rows_of(data) -> dict[str, dict]:
    from fv_accel.data.loader import LatentDataset

    ds = LatentDataset(str(data), text_max_length=64)
    return {ds[(i, 0, 0)]["source"].split("(id '")[1][:-2]: ds[(i, 0, 0)] for i in range(len(ds))}


def test_log_mel_puts_a_tone_in_its_mel_band():
    """LTX-2's front end: samples // hop + 1 frames of `mel_bins` bins; a 440 Hz tone is loudest in
    the bin whose Slaney band holds 440 Hz, a 4 kHz tone in a higher one."""
    from transformers.audio_utils import hertz_to_mel, mel_to_hertz

    from fv_accel.models.ltx2 import log_mel

    rate, hop, bins = 16000, 160, 64
    t = torch.arange(rate) / rate
    mels = {f: log_mel(torch.sin(2 * torch.pi * f * t)[None].repeat(2, 1), rate, hop, bins) for f in (440.0, 4000.0)}
    assert tuple(mels[440.0].shape) == (2, rate // hop + 1, bins)
    edges = mel_to_hertz(np.linspace(hertz_to_mel(0.0, "slaney"), hertz_to_mel(rate / 2, "slaney"), bins + 2), "slaney")
    centre = {f: int(m[0, 50].argmax()) for f, m in mels.items()}
    assert edges[centre[440.0]] < 440.0 < edges[centre[440.0] + 2]
    assert centre[4000.0] > centre[440.0] + 10


def test_preprocess_stores_audio_latents_and_reports_silent_and_short_clips(sound_data):
    model, root, result = sound_data
    assert result.encoded == 3, result.summary
    # 17 frames at 8 fps: round(17 / 8 * 16000 / 160 / 4) = 53 audio latent frames.
    assert result.audio["with_sound"] == 2
    assert result.audio["without_sound"] == ["silent.mp4"]
    assert result.audio["padded"] == ["short.mp4"] and result.audio["cut"] == []
    assert "2 with sound, 1 without (trained video-only)" in result.summary
    assert "1 padded (sound shorter than the picture)" in result.summary
    info = json.loads((root / "data" / "fv_dataset.json").read_text())
    assert info["audio"]["without_sound"] == ["silent.mp4"] and "audio" in info["conditioning"]
    notes = {json.loads(line)["id"]: json.loads(line) for line in (root / "data" / "audio.jsonl").read_text().splitlines()}
    assert notes["short.mp4"]["padded_seconds"] == pytest.approx(17 / 8 - 1.0, abs=0.03)
    rows = rows_of(root / "data")
    for name in ("tone.mp4", "silent.mp4", "short.mp4"):
        assert tuple(rows[name]["audio_latent"].shape) == (2, 53, 4), name
    assert float(rows["silent.mp4"]["audio_present"]) == 0.0
    assert float(rows["silent.mp4"]["audio_latent"].abs().max()) == 0.0
    assert float(rows["tone.mp4"]["audio_present"]) == 1.0 and float(rows["short.mp4"]["audio_present"]) == 1.0
    # The short clip's second half is silence: its latents there differ from the full tone's.
    tone, short = rows["tone.mp4"]["audio_latent"], rows["short.mp4"]["audio_latent"]
    assert float((tone[:, 35:] - short[:, 35:]).abs().max()) > 1e-3


def test_audio_missing_skip_reports_the_silent_clip(sound_data, tmp_path):
    model, _, _ = sound_data
    result = preprocess_sound_clips(model, tmp_path, audio_missing="skip")
    assert result.encoded == 2 and result.skipped == 1
    (skipped,) = [json.loads(line) for line in (tmp_path / "data" / "skipped.jsonl").read_text().splitlines()]
    assert skipped["path"] == "silent.mp4" and skipped["reason"] == "no_audio"
    assert result.audio["skipped_without_sound"] == ["silent.mp4"] and "1 skipped without sound" in result.summary


def audio_only_grad(sound_data, row: str) -> float:
    """max |grad| of the last block's video-to-audio attention (its output reaches the audio
    prediction only) after one joint finetune step on the preprocessed row `row`."""
    from fv_accel.config import default_recipe, load_config
    from fv_accel.data.loader import LatentDataset, collate
    from fv_accel.methods import METHODS
    from fv_accel.models import build_student

    model, root, _ = sound_data
    ds = LatentDataset(str(root / "data"), text_max_length=64)
    (index,) = [i for i in range(len(ds)) if ds[(i, 0, 0)]["source"].endswith(f"(id '{row}')")]
    over = {"models.student.init_from": str(model), "models.student.train_audio": True, "callbacks.validation.enable": False,
            "training.data.text_max_length": 64}
    cfg = load_config(default_recipe("finetune"), over)
    student = build_student(cfg)
    method = METHODS["finetune"](cfg=cfg, role_models={"student": student})
    loss_map, outputs, _ = method.single_train_step(collate([ds[(index, 0, 0)]]), 0)
    # Without sound the audio loss is an exact 0 (kept in the graph for data-parallel runs).
    assert (float(loss_map["audio_loss"]) == 0.0) == (row == "silent.mp4")
    loss_map["total_loss"].backward()
    last = int(student.transformer.config.num_layers) - 1
    grads = [p.grad for n, p in student.transformer.named_parameters() if n.startswith(f"transformer_blocks.{last}.video_to_audio_attn.")]
    return max(float(g.abs().max()) if g is not None else 0.0 for g in grads)


def test_the_stored_sound_trains_the_audio_branch_through_the_audio_loss(sound_data):
    """A clip with sound: the audio loss reaches the layers that only the audio prediction sees; a
    clip without sound (trained video-only): they get no gradient."""
    assert audio_only_grad(sound_data, "tone.mp4") > 0
    assert audio_only_grad(sound_data, "silent.mp4") == 0.0


@pytest.mark.slow
def test_joint_lora_run_on_sound_logs_both_losses_and_moves_audio_only_layers(sound_data, tmp_path):
    from safetensors.torch import load_file

    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    model, root, _ = sound_data
    over = run_overrides(tmp_path, model, root / "data", **{
        "models.student.lora.enable": True, "models.student.train_audio": True, "training.optimizer.learning_rate": 1e-2,
        "training.loop.max_train_steps": 3, "training.data.text_max_length": 64,
    })
    Trainer(build_from_config(default_recipe("finetune"), over)).run()
    out = tmp_path / "out"
    metrics = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    logged = {k for m in metrics for k in m}
    assert any("audio_loss" in k for k in logged) and any("video_loss" in k for k in logged), logged
    lora = load_file(str(out / "pytorch_lora_weights.safetensors"))
    last = [v for k, v in lora.items() if "transformer_blocks.1.video_to_audio_attn" in k and "lora_B" in k]
    assert last and max(float(v.abs().max()) for v in last) > 0  # lora_B starts at zero


def test_read_audio_counts_sound_past_the_picture_as_cut(tmp_path):
    """A track twice as long as its picture: the window is all sound (nothing padded) and the
    second the picture does not cover is reported as cut."""
    from fv_accel.data.audio import read_audio
    from fv_accel.data.video import write_video

    rate, fps, frames = 16000, 8.0, 9
    t = np.arange(int(rate * 2 * frames / fps)) / rate
    tone = (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)[None]
    path = write_video(tmp_path / "long.mp4", np.zeros((frames, 32, 32, 3), np.uint8), fps=fps, audio=(tone, rate))
    got = read_audio(path, start_seconds=0.0, num_samples=int(rate * frames / fps), sample_rate=rate,
                     picture_seconds=frames / fps, slack_seconds=1 / fps)
    assert got.present and got.waveform.shape == (2, int(rate * frames / fps))
    assert got.padded_seconds == 0.0
    # AAC codes whole frames of 1024 samples (64 ms at 16 kHz): the decoded track ends up to one frame later.
    assert frames / fps <= got.cut_seconds <= frames / fps + 1024 / rate
    assert np.array_equal(got.waveform[0], got.waveform[1])  # mono copied to both channels
