"""The MiniMax-H3 family on its tiny model: the modular pipeline (MiniMaxH3ModularPipeline, t2va)
loads it and makes video and sound; preprocessing writes the clips' audio latents with the model's
audio VAE; a video-only LoRA run (train_audio false) changes no audio weight and its LoRA file holds no
audio key; a joint run (train_audio true) changes both; each LoRA loads back in
the modular pipeline's `load_lora_weights` and the pipeline generates; the audio is noised at its own
schedule's level beside the video's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from family_helpers import run_overrides, write_sound_clips

CPU = torch.device("cpu")
FRAMES = 73  # 17 n + 5 (the video VAE's chunks) and 4 k + 1 (preprocessing's frame counts): 22 latent frames
SIDE = 32


@pytest.fixture(scope="module")
def minimax(tmp_path_factory, tiny_model_of):
    """The tiny MiniMax-H3 and its preprocessing of three 24 fps clips: one with sound, one without,
    one whose sound is shorter than its picture."""
    from fv_accel.data.video import FrameSampling
    from fv_accel.preprocess import preprocess

    model = tiny_model_of("minimax_h3")
    root = tmp_path_factory.mktemp("minimax_h3")
    write_sound_clips(root / "clips", fps=24.0, num_frames=FRAMES, size=SIDE)
    sampling = FrameSampling(num_frames=(FRAMES,), buckets=((SIDE, SIDE),), seed=0)
    result = preprocess(str(model), str(root / "clips"), root / "data", sampling, device=CPU, dtype=torch.float32)
    assert result.encoded == 3 and result.audio["with_sound"] == 2, result.summary
    return model, root / "data"


def modular_pipeline(model: Path):
    from diffusers import ModularPipeline

    from fv_accel.models.minimax_h3 import TextTokenTypes

    pipe = ModularPipeline.from_pretrained(str(model))
    pipe.load_components(names=[n for n in pipe.pretrained_component_names if n != "processor"])
    pipe.update_components(processor=TextTokenTypes())  # transformers builds no Qwen3VLProcessor without torchvision
    return pipe


def generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(video [1, F, 3, H, W] in [0, 1], audio [1, 2, samples]) of a 5 s (the model's shortest) 32x32 request."""
    out = pipe(prompt="a red ball", height=SIDE, width=SIDE, num_frames=124, num_inference_steps=3, output_type="pt",
               generator=torch.Generator().manual_seed(0))
    return out.get("videos"), out.get("audio")


def test_preprocessing_stores_the_audio_vae_latents_of_the_pipeline_length(minimax):
    from fv_accel.data.loader import LatentDataset, collate

    model, data = minimax
    rows = [collate([LatentDataset(str(data))[(i, 0, 0)]]) for i in range(3)]
    for row in rows:
        assert tuple(row["vae_latent"].shape) == (1, 24, 22, SIDE // 4, SIDE // 4)
        # 73 frames at 24 fps, 40 audio latents per second: the pipeline's audio_latent_num_frames.
        assert tuple(row["audio_latent"].shape) == (1, 2, 32, 122)
    present = sorted(float(r["audio_present"]) for r in rows)
    assert present == [0.0, 1.0, 1.0]
    silent = next(r for r in rows if float(r["audio_present"]) == 0.0)
    assert not silent["audio_latent"].abs().sum()
    tone = next(r for r in rows if "tone" in r["source"][0])
    assert float(tone["audio_latent"].std()) > 0


def test_the_modular_pipeline_makes_video_and_sound(tiny_model_of):
    video, audio = generate(modular_pipeline(tiny_model_of("minimax_h3")))
    assert tuple(video.shape) == (1, 124, 3, SIDE, SIDE) and 0.0 <= float(video.min()) <= float(video.max()) <= 1.0
    # 124 frames at 24 fps -> 207 audio latents, 800 samples each at 32 kHz.
    assert tuple(audio.shape) == (1, 2, 207 * 800) and bool(torch.isfinite(audio).all()) and float(audio.abs().max()) > 0


def test_audio_is_noised_in_step_with_the_video():
    """The audio sigma beside a video sigma: the same base level through shift 3 instead of 12."""
    from fv_accel.models.minimax_h3 import audio_sigma_in_step, shift_sigma

    base = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0])
    video = shift_sigma(base, 12.0)
    audio = audio_sigma_in_step(video, 12.0, 3.0)
    assert torch.allclose(audio, shift_sigma(base, 3.0), atol=1e-6)
    assert [round(float(v), 4) for v in audio] == [0.0, 0.25, 0.75, 0.9643, 1.0]


def train(tmp_path: Path, minimax, **extra) -> Path:
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    model, data = minimax
    over = run_overrides(tmp_path, model, data, **{
        "models.student.lora.enable": True, "training.data.text_max_length": 64, "training.loop.max_train_steps": 3,
        "training.optimizer.learning_rate": 1e-2, **extra,
    })
    Trainer(build_from_config(default_recipe("finetune"), over)).run()
    return tmp_path / "out"


def lora_deltas(out: Path, model: Path) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """max |delta W| per base weight of the transformer from the run's LoRA file, loaded by the
    modular pipeline's own load_lora_weights (MiniMaxH3LoraLoaderMixin), which then generates; and
    the fused weights."""
    pipe = modular_pipeline(model)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(str(out))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    after = pipe.transformer.state_dict()
    video, audio = generate(pipe)
    assert tuple(video.shape) == (1, 124, 3, SIDE, SIDE) and bool(torch.isfinite(audio).all())
    return {k: float((after[k] - v).abs().max()) for k, v in before.items()}, after


def test_video_only_lora_keeps_every_audio_weight(tmp_path, minimax):
    out = train(tmp_path, minimax)
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert keys and not [k for k in keys if "audio" in k]
    deltas, _ = lora_deltas(out, minimax[0])
    audio = {k: d for k, d in deltas.items() if "audio" in k}
    video = {k: d for k, d in deltas.items() if "audio" not in k}
    print(f"video-only LoRA: {len(audio)} audio weights, max |delta| {max(audio.values())}; "
          f"{len(video)} other weights, max |delta| {max(video.values()):.3g}")
    assert sorted(audio) == ["audio_proj_in.bias", "audio_proj_in.weight", "audio_proj_out.bias", "audio_proj_out.weight"]
    assert max(audio.values()) == 0.0 and max(video.values()) > 0


def test_joint_lora_changes_both(tmp_path, minimax):
    out = train(tmp_path, minimax, **{"models.student.train_audio": True})
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert [k for k in keys if "audio_proj_in" in k] and [k for k in keys if "audio_proj_out" in k]
    deltas, fused = lora_deltas(out, minimax[0])
    audio = max(d for k, d in deltas.items() if k.startswith("audio_proj_"))
    video = max(d for k, d in deltas.items() if k.endswith("attn.to_q.weight"))
    print(f"joint LoRA: max |delta| audio projections {audio:.3g}, attention to_q {video:.3g}")
    assert audio > 0 and video > 0
    # The merged export holds the weights the pipeline's own fuse gives, audio projections included.
    from diffusers import MiniMaxH3Transformer3DModel

    from fv_accel.export import export_merged, find_source

    (written,) = export_merged(find_source(out), tmp_path / "merged")
    merged = MiniMaxH3Transformer3DModel.from_pretrained(str(written)).state_dict()
    assert sorted(merged) == sorted(fused)
    for k in fused:
        torch.testing.assert_close(merged[k], fused[k], rtol=0, atol=1e-5)


def test_the_recipe_dry_runs_offline_with_a_memory_estimate(capsys, monkeypatch):
    import yaml

    from fv_accel.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main("finetune", ["--config", "configs/minimax_h3_t2va_lora.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# memory estimate per process" in out  # offline: the published architecture
    printed = yaml.safe_load(out)
    st, data = printed["models"]["student"], printed["training"]["data"]
    assert (st["init_from"], st["train_audio"], st["lora"]["enable"], st["lora"]["rank"]) == ("MiniMaxAI/MiniMax-H3", True, True, 32)
    assert (data["num_frames"], data["num_latent_t"], data["num_height"], data["num_width"]) == (141, 42, 768, 1344)


@pytest.mark.parametrize("override,words", [
    ({"callbacks.validation.enable": True}, "callbacks.validation.enable"),
    ({"models.student.task": "i2v"}, "t2va"),
    ({"models.student.train_audio": True, "method.name": "dfsft"}, "train_audio"),
])
def test_what_the_family_cannot_do_is_refused_in_one_line(tiny_model_of, override, words):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.models import build_student

    override = dict(override)
    method = override.pop("method.name", "finetune")
    cfg = load_config(default_recipe(method), {"models.student.init_from": str(tiny_model_of("minimax_h3")), **override})
    with pytest.raises(Exception) as err:
        build_student(cfg)
    message = str(err.value)
    assert words in message and "\n" not in message, message
