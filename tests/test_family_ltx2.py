"""The LTX-2 family on its tiny model: the stock LTX2Pipeline loads it and makes video and sound;
a video-only LoRA run (train_audio false) changes no audio or cross-modal weight and its LoRA file
holds no audio key; a joint run (train_audio true) changes both branches and logs both losses; each
LoRA loads back in LTX2Pipeline.load_lora_weights and the pipeline generates; DMD2 on LTX-2 roles
trains the video with the audio branch hearing silence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from family_helpers import preprocess_sound_clips, run_overrides
from fv_accel.models.ltx2 import is_audio_or_cross_modal

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory, tiny_model_of):
    """The tiny LTX-2 and its preprocessing of three clips: one with sound, one without, one whose
    sound is shorter than its picture."""
    model = tiny_model_of("ltx2")
    root = tmp_path_factory.mktemp("ltx2")
    result = preprocess_sound_clips(model, root)
    assert result.encoded == 3 and result.audio["with_sound"] == 2, result.summary
    return model, root / "data"


def generate(pipe):
    return pipe(prompt="a red ball", num_frames=9, height=64, width=64, num_inference_steps=2, guidance_scale=1.0,
                output_type="pt", max_sequence_length=64, generator=torch.Generator().manual_seed(0))


# tiny model -> (release its transformer's flags say, vocoder class, its output rate, text encoder class)
LTX2_RELEASES = {
    "ltx2": ("2.0", "LTX2Vocoder", 16000, "Gemma3ForConditionalGeneration"),
    "ltx2_3": ("2.3", "LTX2VocoderWithBWE", 48000, "Gemma3ForConditionalGeneration"),
    "ltx2_5": ("2.5", "LTX2VocoderWithBWE", 48000, "Gemma4UnifiedForConditionalGeneration"),
}


@pytest.mark.parametrize("name", sorted(LTX2_RELEASES))
def test_the_stock_pipeline_loads_the_tiny_ltx2_and_makes_video_and_sound(tiny_model_of, name):
    """Each tiny release loads in the stock LTX2Pipeline (its own vocoder and text encoder classes)
    and makes 9 frames with stereo sound as long as the picture at the vocoder's rate."""
    from diffusers import DiffusionPipeline, LTX2Pipeline

    from fv_accel.models.ltx2 import ltx2_version

    release, vocoder, rate, text_encoder = LTX2_RELEASES[name]
    pipe = DiffusionPipeline.from_pretrained(str(tiny_model_of(name)))
    assert type(pipe) is LTX2Pipeline and ltx2_version(pipe.transformer.config) == release
    assert (type(pipe.vocoder).__name__, pipe.vocoder.config.output_sampling_rate, type(pipe.text_encoder).__name__) == (
        vocoder, rate, text_encoder
    )
    # Every release's conversion writes split rotary embeddings (the classes' default is interleaved).
    assert (pipe.transformer.config.rope_type, pipe.connectors.config.rope_type) == ("split", "split")
    out = generate(pipe)
    assert tuple(out.frames.shape) == (1, 9, 3, 64, 64)
    # Stereo, about 9 / 24 s (the mel frames the audio VAE's causal decoder gives back, upsampled).
    assert out.audio.shape[:2] == (1, 2) and out.audio.shape[-1] / rate == pytest.approx(9 / 24, abs=0.06)
    assert bool(torch.isfinite(out.audio).all())


def train(tmp_path: Path, ltx2, **extra) -> Path:
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    model, data = ltx2
    over = run_overrides(tmp_path, model, data, **{"models.student.lora.enable": True, "training.data.text_max_length": 64, **extra})
    Trainer(build_from_config(default_recipe("finetune"), over)).run()
    return tmp_path / "out"


def lora_deltas(out: Path, model: Path) -> dict[str, float]:
    """max |delta W| per base weight of the transformer from the run's LoRA file (B @ A * scale)."""
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(str(model))
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(str(out))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    after = pipe.transformer.state_dict()
    out = generate(pipe)
    assert tuple(out.frames.shape) == (1, 9, 3, 64, 64)
    assert out.audio.shape[:2] == (1, 2) and out.audio.shape[-1] > 1000 and bool(torch.isfinite(out.audio).all())
    return {k: float((after[k] - v).abs().max()) for k, v in before.items()}


def read_metrics(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_video_only_lora_keeps_every_audio_and_cross_modal_weight(tmp_path, ltx2):
    out = train(tmp_path, ltx2, **{"training.optimizer.learning_rate": 1e-2})
    lora = load_file(str(out / "pytorch_lora_weights.safetensors"))
    keys = list(lora)
    assert keys and not [k for k in keys if is_audio_or_cross_modal(k)]
    # ComfyUI's layout (its LTXAVModel keeps these block names): the same tensors, lora_down/lora_up.
    comfy = load_file(str(out / "pytorch_lora_weights_comfyui.safetensors"))
    for key, value in lora.items():
        name = key.replace("transformer.", "diffusion_model.", 1)
        name = name.replace(".lora_A.weight", ".lora_down.weight").replace(".lora_B.weight", ".lora_up.weight")
        assert torch.equal(comfy[name], value), name
    assert "diffusion_model.transformer_blocks.0.attn1.to_out.0.alpha" in comfy
    assert not [k for k in comfy if is_audio_or_cross_modal(k)]
    deltas = lora_deltas(out, ltx2[0])
    audio = {k: d for k, d in deltas.items() if is_audio_or_cross_modal(k)}
    video = {k: d for k, d in deltas.items() if not is_audio_or_cross_modal(k)}
    print(f"video-only LoRA: {len(audio)} audio/cross-modal weights, max |delta| {max(audio.values())}; "
          f"{len(video)} video weights, max |delta| {max(video.values()):.3g}")
    assert audio and max(audio.values()) == 0.0
    assert max(video.values()) > 0


@pytest.mark.slow
def test_joint_lora_changes_both_branches(tmp_path, ltx2):
    out = train(tmp_path, ltx2, **{"training.optimizer.learning_rate": 1e-2, "models.student.train_audio": True})
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert [k for k in keys if "audio_attn1" in k] and [k for k in keys if "video_to_audio_attn" in k]
    deltas = lora_deltas(out, ltx2[0])
    print("joint LoRA: max |delta| audio_attn1 %.3g, video_to_audio_attn %.3g, video attn1.to_q %.3g" % (
        max(d for k, d in deltas.items() if "audio_attn1" in k), max(d for k, d in deltas.items() if "video_to_audio_attn" in k),
        max(d for k, d in deltas.items() if k.endswith("attn1.to_q.weight") and "audio" not in k)))
    assert max(d for k, d in deltas.items() if "audio_attn1" in k) > 0
    assert max(d for k, d in deltas.items() if k.endswith("attn1.to_q.weight") and "audio" not in k) > 0


def test_joint_step_adds_the_weighted_audio_loss_and_reports_both(ltx2):
    """A batch with sound (an audio latent of the pipeline's length for 17 frames at 24 fps): the
    finetune step's total is video + training.audio.loss_weight * audio, both in its loss map; with
    train_audio false the total is the video loss alone."""
    from fv_accel.config import default_recipe, load_config
    from fv_accel.data.loader import LatentDataset, collate
    from fv_accel.methods import METHODS
    from fv_accel.models import build_student

    model, data = ltx2
    batch = collate([LatentDataset(str(data))[(0, 0, 0)]])
    torch.manual_seed(0)
    batch["audio_latent"] = torch.randn(1, 2, 18, 4)  # [B, C, L, M]: round(17 / 24 * 25) latent frames
    batch["audio_present"] = torch.ones(1)
    maps = {}
    for joint in (True, False):
        over = {"models.student.init_from": str(model), "models.student.train_audio": joint,
                "training.audio.loss_weight": 0.5, "callbacks.validation.enable": False}
        cfg = load_config(default_recipe("finetune"), over)
        student = build_student(cfg)
        method = METHODS["finetune"](cfg=cfg, role_models={"student": student})
        maps[joint], _, _ = method.single_train_step(batch, 0)
    joint = maps[True]
    assert float(joint["audio_loss"]) > 0
    assert torch.allclose(joint["total_loss"], joint["video_loss"] + 0.5 * joint["audio_loss"])
    assert "audio_loss" not in maps[False] and torch.isfinite(maps[False]["total_loss"])


@pytest.mark.slow
def test_sample_videos_carry_the_sound_the_pipeline_made(tmp_path, ltx2):
    """Validation samples through LTX2Pipeline around the live transformer: the mp4 has an AAC track as
    long as its picture at the pipeline's 24 fps (17 frames: 0.71 s)."""
    import av

    train(tmp_path, ltx2, **{
        "training.loop.max_train_steps": 1, "callbacks.validation.enable": True, "callbacks.validation.prompts": ["a red ball"],
        "callbacks.validation.sampling_steps": 2, "callbacks.validation.guidance_scale": 1.0,
        "callbacks.validation.every_steps": 1,
    })
    (video,) = (tmp_path / "out" / "samples" / "step-1").glob("*.mp4")
    with av.open(str(video)) as container:
        picture, sound = container.streams.video[0], container.streams.audio[0]
        seconds = [float(s.duration * s.time_base) for s in (picture, sound)]
        assert sound.codec_context.name == "aac" and sound.codec_context.channels == 2
    assert seconds[0] == pytest.approx(17 / 24, abs=1e-3)
    assert seconds[1] == pytest.approx(seconds[0], abs=0.05)


# ---- LTX-2.3 and LTX-2.5 ----


# LTX-2.3 (the release); LTX-2.5 differs from it in the transformer's flags and the text
# encoder, whose inputs test_pipeline_consistency.py::test_ltx2[ltx2_5-t2v] holds to the pipeline's.
@pytest.mark.parametrize("name", ["ltx2_3"])
def test_a_release_trains_a_lora_the_stock_pipeline_loads_and_exports_merged(tmp_path, tiny_model_of, name):
    """LTX-2.3 through the LTX-2 family: its clips with sound preprocessed by its own encoders, 3
    video-only LoRA steps, a LoRA file LTX2Pipeline.load_lora_weights takes and whose effect changes
    the pipeline's video; the checkpoint merged into a transformer of the same release (its flags
    kept) with only video attention weights changed."""
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

    from fv_accel.export import export_merged, find_source
    from fv_accel.models.ltx2 import ltx2_version

    model = tiny_model_of(name)
    result = preprocess_sound_clips(model, tmp_path)
    assert result.encoded == 3 and result.audio["with_sound"] == 2, result.summary
    out = train(tmp_path, (model, tmp_path / "data"), **{
        "training.loop.max_train_steps": 3, "training.optimizer.learning_rate": 1e-2, "training.optimizer.lr_warmup_steps": 0,
        "training.checkpoint.training_state_checkpointing_steps": 3,
    })
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert len(keys) == 2 * 2 * 4 * 2 and not [k for k in keys if is_audio_or_cross_modal(k)]  # blocks x attn x proj x A/B
    pipe = LTX2Pipeline.from_pretrained(str(model))
    before = generate(pipe).frames
    pipe.load_lora_weights(str(out))
    after = generate(pipe)
    change = float((after.frames - before).abs().max())
    print(f"{name}: LoRA changes the pipeline's video by up to {change:.3g}")
    assert change > 1e-3 and bool(torch.isfinite(after.audio).all())

    (written,) = export_merged(find_source(out / "checkpoint-3"), tmp_path / "merged")
    merged = LTX2VideoTransformer3DModel.from_pretrained(str(written))
    base = LTX2VideoTransformer3DModel.from_pretrained(str(model), subfolder="transformer")
    assert ltx2_version(merged.config) == LTX2_RELEASES[name][0]
    assert {k: v for k, v in merged.config.items() if k != "_name_or_path"} == {
        k: v for k, v in base.config.items() if k != "_name_or_path"
    }
    merged_state = merged.state_dict()
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, merged_state[k])]
    assert len(changed) == 2 * 2 * 4 and all(".attn1." in k or ".attn2." in k for k in changed), changed


def test_an_unknown_release_flag_or_text_encoder_is_refused_in_one_line(tmp_path, tiny_model_of):
    """A transformer config key the installed diffusers does not take (a newer release's) and a text
    encoder the family does not run are each refused in one line naming the key or the class."""
    from fv_accel.models import build_student
    from fv_accel.config import default_recipe, load_config
    from fv_accel.models.ltx2 import text_encoder_class

    model = tmp_path / "ltx2_3"
    shutil.copytree(tiny_model_of("ltx2_3"), model)
    config = json.loads((model / "transformer" / "config.json").read_text())
    (model / "transformer" / "config.json").write_text(json.dumps({**config, "use_future_flag": True}))
    cfg = load_config(default_recipe("finetune"), {"models.student.init_from": str(model), "callbacks.validation.enable": False})
    with pytest.raises(ValueError) as err:
        build_student(cfg)
    assert "\n" not in str(err.value) and "sets use_future_flag, which diffusers" in str(err.value)
    assert str(err.value).endswith("(a newer LTX-2 release than LTX-2.3): upgrade diffusers")
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "text_encoder": ["transformers", "T5EncoderModel"]}))
    with pytest.raises(ValueError) as err:
        text_encoder_class(str(model))
    assert "\n" not in str(err.value) and "text encoder T5EncoderModel is not one the LTX-2 family runs" in str(err.value)


# ---- recipes ----

ROOT = Path(__file__).resolve().parents[1]
# recipe -> (Hub id, train_audio, LoRA rank or None for a full fine-tune)
LTX2_RECIPES = {
    "ltx2_t2v_lora": ("Lightricks/LTX-2", False, 64),
    "ltx2_t2av_lora": ("Lightricks/LTX-2", True, 64),
    "ltx2_3_t2v": ("diffusers/LTX-2.3-Distilled-Diffusers", False, None),
    "ltx2_3_t2v_lora": ("diffusers/LTX-2.3-Distilled-Diffusers", False, 16),
}


@pytest.mark.parametrize("name", sorted(LTX2_RECIPES))
def test_ltx2_recipes_dry_run_offline_with_the_memory_estimate(name, capsys, monkeypatch):
    """Each recipe prints offline (the Hub id of diffusers' LTX-2 pipelines' docstrings, no network)
    with the memory estimate of the published architecture (LTX-2.0, or LTX-2.3: the same widths with
    gated attention): LoRA on the video attention (attn1, attn2: 4 projections 4096 -> 4096 each, 48
    blocks), and with train_audio also on the audio attention (2048 wide) and the cross-modal
    attention (2048 wide, keys and values of the video for audio-to-video from 4096); a full
    fine-tune counts every weight, the gates of the 2.3 attention included."""
    import yaml

    from fv_accel.cli import main

    repo, train_audio, rank = LTX2_RECIPES[name]
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main("finetune", ["--config", f"configs/{name}.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    st = yaml.safe_load(out)["models"]["student"]
    assert st["init_from"] == repo and st["train_audio"] is train_audio and st["lora"]["enable"] is (rank is not None)
    if rank is None:
        assert "full fine-tune (18,988,838,144 parameters)" in out, out[-1500:]
        return
    layers = 48

    def lora(i, o):
        return rank * (i + o)

    video = 8 * lora(4096, 4096)
    audio = 8 * lora(2048, 2048)
    # audio_to_video_attn: queries from the video (4096), keys/values from the audio (2048), output 4096 -> inner
    # 2048 -> 4096; video_to_audio_attn the other way round.
    a2v = lora(4096, 2048) + lora(2048, 2048) * 2 + lora(2048, 4096)
    v2a = lora(2048, 2048) + lora(4096, 2048) * 2 + lora(2048, 2048)
    expected = layers * (video + (audio + a2v + v2a if train_audio else 0))
    assert f"LoRA rank {rank} ({expected:,} of " in out, out[-1500:]


def test_the_ltx2_3_recipes_have_fastvideos_values():
    """FastVideo's LTX-2.3 fine-tuning values: 81 frames at 480x832, no weight decay, constant LR,
    2000 steps, clip 1.0, samples every 250 steps at the distilled checkpoint's 8 steps and guidance
    1; full: lr 5e-5; LoRA: rank 16, alpha 32, lr 1e-4."""
    from fv_accel.config import load_config

    for name, lr, lora in (("ltx2_3_t2v", 5e-5, None), ("ltx2_3_t2v_lora", 1e-4, (16, 32.0))):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        d, o, v = cfg.training.data, cfg.training.optimizer, cfg.callbacks.validation
        assert (d.num_frames, d.num_height, d.num_width, d.train_batch_size, d.text_max_length) == (81, 480, 832, 1, 1024)
        assert (o.learning_rate, o.weight_decay, o.lr_scheduler, o.lr_warmup_steps) == (lr, 0.0, "constant", 0)
        assert (cfg.training.loop.max_train_steps, cfg.callbacks.grad_clip.max_grad_norm) == (2000, 1.0)
        assert (v.every_steps, v.sampling_steps, v.guidance_scale, v.num_frames) == (250, 8, 1.0, 81)
        lo = cfg.models.student.lora
        assert ((lo.rank, lo.alpha) if lo.enable else None) == lora


def test_train_audio_on_a_family_without_sound_is_refused_in_one_line():
    from fv_accel.config import default_recipe, load_config
    from fv_accel.models import build_student

    cfg = load_config(default_recipe("finetune"), {"models.student.train_audio": True, "callbacks.validation.enable": False})
    with pytest.raises(ValueError) as err:
        build_student(cfg)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("models.student.train_audio is true but model 'models.student.transformer_config' (wan family)")


def test_heldout_loss_reports_video_and_audio_apart(tmp_path, ltx2):
    """The held-out evaluation feeds each clip's sound (its noise from the clip's fixed generator) and
    logs the audio loss apart (`heldout/audio_loss`, per sigma bucket, over the clips with sound)
    beside the video's (`heldout/loss`)."""
    _, data = ltx2
    out = train(tmp_path, ltx2, **{
        "training.loop.max_train_steps": 1, "callbacks.validation.enable": True, "callbacks.validation.prompts": [],
        "callbacks.validation.heldout_data_path": str(data), "callbacks.validation.heldout_max_samples": 3,
        "callbacks.validation.every_steps": 1,
    })
    logs = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    heldout = [m for m in logs if "heldout/loss" in m][-1]
    buckets = [k for k in heldout if k.startswith("heldout/audio_sigma_")]
    assert len(buckets) == 5 and heldout["heldout/audio_loss"] == pytest.approx(sum(heldout[k] for k in buckets) / 5)
    assert heldout["heldout/audio_loss"] > 0 and heldout["heldout/loss"] > 0
    assert heldout["heldout/audio_loss"] != heldout["heldout/loss"]


@pytest.mark.slow
def test_joint_run_resumes_exactly(tmp_path, ltx2):
    """A joint (video + audio) LoRA run stopped at step 2 and resumed replays steps 3 and 4 as the
    uninterrupted run: the same video and audio losses, the same LoRA weights."""
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer
    from resume_helpers import reset_accelerate

    model, data = ltx2

    def run(out, **extra):
        over = run_overrides(out, model, data, **{
            "models.student.lora.enable": True, "models.student.train_audio": True, "training.data.text_max_length": 64,
            "training.loop.max_train_steps": 4, "training.optimizer.lr_warmup_steps": 3,
            "training.checkpoint.training_state_checkpointing_steps": 2, **extra,
        })
        reset_accelerate()
        Trainer(build_from_config(default_recipe("finetune"), over)).run()
        logs = [json.loads(line) for line in (out / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
        losses = {m["step"]: (m["total_loss"], m.get("video_loss"), m.get("audio_loss")) for m in logs if "total_loss" in m}
        return losses, load_file(str(out / "out" / "pytorch_lora_weights.safetensors"))

    straight, straight_lora = run(tmp_path / "a")
    resumed, resumed_lora = run(tmp_path / "b", **{
        "training.checkpoint.resume_from_checkpoint": str(tmp_path / "a" / "out" / "checkpoint-2"),
    })
    assert sorted(resumed) == [3, 4] and sorted(straight) == [1, 2, 3, 4]  # it started from the checkpoint
    assert [resumed[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]
    assert any(straight[s][2] is not None for s in (3, 4))  # an audio loss among the replayed steps
    assert straight_lora.keys() == resumed_lora.keys()
    assert all(torch.equal(straight_lora[k], resumed_lora[k]) for k in straight_lora)


@pytest.mark.slow
@pytest.mark.multiproc
def test_joint_run_on_two_processes_ddp_and_fsdp2(tmp_path, ltx2):
    """Joint LoRA training on two CPU processes, under DDP and under FSDP2: a step where one process
    holds a clip without sound and the other one with sound runs (both log the same keys and reduce
    the same gradients), and the two engines log the same losses."""
    import os
    import subprocess
    import sys

    from launch_helpers import ANY_FREE_PORT

    model, data = ltx2
    accelerate = Path(sys.executable).parent / "accelerate"
    logs = {}
    for engine, launch in (("DDP", ["--multi_gpu"]), ("FSDP2", ["--config_file", str(ROOT / "accelerate_configs" / "fsdp2.yaml")])):
        out = tmp_path / engine
        env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
        env.update(OMP_NUM_THREADS="1", **({"ACCELERATE_USE_CPU": "1"} if engine == "DDP" else {}))
        cmd = [str(accelerate), "launch", *launch, "--num_processes", "2", *ANY_FREE_PORT, "train_finetune.py",
               "--config", "configs/tiny_finetune.yaml", "--models.student.init_from", str(model),
               "--models.student.lora.enable", "true", "--models.student.train_audio", "true",
               "--training.data.data_path", str(data), "--training.data.train_batch_size", "1",
               "--training.loop.max_train_steps", "3", "--callbacks.validation.enable", "false", "--callbacks.ema.enable", "false",
               "--training.checkpoint.output_dir", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert f"engine {engine}" in proc.stderr and "| 2 processes |" in proc.stderr
        logs[engine] = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    shares = [m["audio_share"] for m in logs["DDP"]]
    assert 0.5 in shares, shares  # a step with sound on one process only
    for a, b in zip(logs["DDP"], logs["FSDP2"]):
        for key in ("video_loss", "audio_loss", "total_loss"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (key, a["step"])


@pytest.mark.slow
def test_tiny_data_path_follows_an_ltx2_student(tmp_path, tiny_model_of, caplog):
    """`data_path: tiny` with an LTX-2 student (the issue's video-only command, 2 steps): the recipe's
    clips (21 frames at 48x48) are encoded by the student's own model at the nearest size its VAE
    takes (25 frames at 64x64), each with a tone, and the LoRA trains on them without an audio key."""
    import logging

    from conftest import tiny_overrides
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.data.schema import read_dataset_info
    from fv_accel.trainer import Trainer

    model = tiny_model_of("ltx2")
    over = tiny_overrides(tmp_path, **{
        "models.student.init_from": str(model), "models.student.lora.enable": True,
        "training.loop.max_train_steps": 2, "training.data.text_max_length": 64,
    })
    with caplog.at_level(logging.INFO, logger="fv_accel.tiny.data"):
        run = build_from_config(default_recipe("finetune"), over)
    assert run.config.training.data.data_path == "tiny"
    info = read_dataset_info(run.dataloader.dataset.data_path)
    assert (info["family"], info["model"], info["vae_class"]) == ("ltx2", str(model), "AutoencoderKLLTX2Video")
    assert info["preprocessing"]["num_frames"] == [25] and info["preprocessing"]["buckets"] == [[64, 64]]
    assert info["audio"]["with_sound"] == info["num_rows"] == 8
    assert "21 frames at 48x48 -> 25 frames at 64x64" in caplog.text
    Trainer(run).run()
    keys = list(load_file(str(tmp_path / "out" / "pytorch_lora_weights.safetensors")))
    assert keys and not [k for k in keys if is_audio_or_cross_modal(k)]


def test_dmd2_trains_the_ltx2_video_while_every_role_hears_silence(tmp_path, ltx2):
    """DMD2 with LTX-2 roles trains the video only, as FastVideo's does: each role's audio branch is
    fed silence as pure noise (sigma 1, drawn after the preparation's video draws); one step with the
    student's update changes the student's and the critic's video weights and no audio or
    cross-modal weight of either."""
    from dmd2_helpers import DMD2_RECIPE, dmd2_overrides
    from fv_accel.build import build_from_config
    from fv_accel.trainer import Trainer

    model, data = ltx2
    over = dmd2_overrides(tmp_path, **{
        "models.teacher.init_from": str(model), "models.teacher.transformer_config": None,
        "training.data.data_path": str(data), "training.data.train_batch_size": 1, "training.data.text_max_length": 64,
        "method.rollout_mode": "data_latent", "method.generator_update_interval": 1, "training.loop.max_train_steps": 1,
        "training.optimizer.learning_rate": 1e-2, "method.fake_score_learning_rate": 1e-2, "training.checkpoint.save_final": False,
    })
    run = build_from_config(DMD2_RECIPE, over)
    before = {role: {k: v.clone() for k, v in getattr(run.method, role).transformer.state_dict().items()} for role in ("student", "critic")}
    prepared = []
    original = run.method._prepare_dmd_batch

    def prepare(batch):
        prepared.append(original(batch))
        return prepared[-1]

    run.method._prepare_dmd_batch = prepare
    Trainer(run).run()
    (tb,) = prepared
    extras = tb.conditioning.extras
    assert torch.equal(extras["audio_sigmas"], torch.ones(1)) and not bool(tb.extras["audio"].present.any())
    assert torch.equal(extras["audio_noisy"], tb.extras["audio_noise"])  # pure noise
    for role in ("student", "critic"):
        after = getattr(run.method, role).transformer.state_dict()
        moved = {k: float((after[k] - v).abs().max()) for k, v in before[role].items()}
        audio = [d for k, d in moved.items() if is_audio_or_cross_modal(k)]
        video = [d for k, d in moved.items() if not is_audio_or_cross_modal(k)]
        assert audio and max(audio) == 0.0, role
        assert max(video) > 0, role
