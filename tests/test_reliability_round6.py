"""Round 6 of bad input on the new features (issue 49): each gets one clear line naming the file,
key or value, at build where it can be known there, or a correct result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from dmd2_helpers import DMD2_RECIPE, TINY_TEACHER, dmd2_overrides
from fv_accel import Trainer, build_from_config
from fv_accel.config import ConfigError, default_recipe, load_config
from resume_helpers import write_latent_dataset


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> str:
    """Six small clips of 6 latent frames (two Self-Forcing chunks of 3) in the tiny Wan's latent
    space and text width: the distillation recipes' data at a fraction of the tiny world's cost."""
    return write_latent_dataset(tmp_path_factory.mktemp("round6_latents"), frames=6)


# ---- R6.1: every role against the student's family, latent channels and text width ----
# The tiny LTX-Video's transformer config (python -m fv_accel.tiny_model M --model ltx_video), pasted inline.
TINY_LTX_VIDEO = {
    "_class_name": "LTXVideoTransformer3DModel", "in_channels": 16, "out_channels": 16, "num_attention_heads": 2,
    "attention_head_dim": 16, "cross_attention_dim": 32, "caption_channels": 32, "num_layers": 1, "patch_size": 1,
    "patch_size_t": 1, "qk_norm": "rms_norm_across_heads",
}


def test_a_role_of_another_family_channels_or_text_width_is_refused_at_build(tmp_path, latents):
    """A critic of another family (as an LTX-Video model beside a Wan student) is refused before its
    weights load; one of the student's family with other latent channels or text width as it is built."""
    fix = "give models.critic a model of the student's family, latent space and text encoder"
    cases = {
        "family": ({"models.critic.transformer_config": TINY_LTX_VIDEO},
                   "models.critic: 'models.critic.transformer_config' is of the ltx_video family, the student of the wan "
                   f"family: the critic works on the student's latents and text embeddings; {fix}"),
        "channels": ({"models.critic.transformer_config": {**TINY_TEACHER, "in_channels": 48, "out_channels": 48}},
                     f"models.critic: 'models.critic.transformer_config' takes 48 latent channels, the student 16; {fix}"),
        "text": ({"models.critic.transformer_config": {**TINY_TEACHER, "text_dim": 64}},
                 f"models.critic: 'models.critic.transformer_config' takes text embeddings 64 wide (text_dim), the "
                 f"student's are 32 wide; {fix}"),
    }
    for name, (over, message) in cases.items():
        with pytest.raises(ConfigError) as err:
            build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path / name, **{"training.data.data_path": latents, **over}))
        assert str(err.value) == message, name
        assert not (tmp_path / name / "out").exists(), name


# ---- R6.2: step lists run from the noisiest entry down ----
@pytest.mark.parametrize("recipe, key, value, example", [
    ("dmd2", "method.dmd_denoising_steps", [250, 1000], "e.g. [1000, 750, 500, 250]"),
    ("self_forcing", "method.dmd_denoising_steps", [1000, 500, 500], "e.g. [1000, 750, 500, 250]"),
    ("diffusion_nft", "method.sampling.timesteps", [250.0, 1000.0], "e.g. [1000, 750, 500, 250]"),
    ("diffusion_nft", "method.sampling.sigmas", [0.25, 1.0], "e.g. [1.0, 0.75, 0.5, 0.25]"),
    ("kd", "method.t_list", [300, 500, 750, 1000, 0], "e.g. [1000, 937, 833, 624, 0]"),
])
def test_a_step_list_not_strictly_descending_is_refused_when_the_recipe_loads(recipe, key, value, example):
    path = default_recipe(recipe)
    with pytest.raises(ConfigError) as err:
        load_config(path, {key: value})
    assert str(err.value) == (
        f"{path} (with overrides {key}): key '{key}': expected strictly descending values, the noisiest first "
        f"({example}), got {value!r}"
    )
    assert load_config(path, {key: sorted(value, reverse=True)[:2]})  # descending: accepted


# ---- R6.3: a changed critic optimizer on resume goes into the critic's optimizer ----
def test_a_resume_with_a_changed_critic_lr_and_betas_applies_them_to_the_critic(tmp_path, latents):
    common = {"training.checkpoint.training_state_checkpointing_steps": 1, "training.loop.max_train_steps": 1,
              "training.checkpoint.save_final": False, "training.data.data_path": latents}
    Trainer(build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path, **common))).run()
    resumed = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path, **{
        **common, "training.loop.max_train_steps": 2, "training.checkpoint.resume_from_checkpoint": "latest",
        "method.fake_score_learning_rate": 5e-4, "method.fake_score_betas": [0.5, 0.9]}))
    assert resumed.start_step == 1
    seen = {}
    for role, optimizer in resumed.method.optimizer_dict.items():
        group = optimizer.param_groups[0]
        base_lrs = resumed.method.lr_scheduler_dict[role].scheduler.base_lrs
        seen[role] = (group["lr"], group["initial_lr"], tuple(group["betas"]), base_lrs)
    assert seen["critic"] == (5e-4, 5e-4, (0.5, 0.9), [5e-4])
    assert seen["student"] == (1e-3, 1e-3, (0.0, 0.999), [1e-3])  # the student's recipe is unchanged
    changed = {c["key"] for c in resumed.trainer_state["recipe_changes"]}
    assert {"method.fake_score_learning_rate", "method.fake_score_betas"} <= changed
    Trainer(resumed).run()
    assert resumed.method.critic_optimizer.param_groups[0]["lr"] == 5e-4  # the constant schedule keeps it


# ---- R6.8: what can be known at build is refused at build; a run that took no step leaves a reusable folder ----
def test_a_self_forcing_chunk_that_does_not_divide_the_clip_is_refused_at_build(tmp_path, latents):
    from self_forcing_helpers import SF_RECIPE, self_forcing_overrides

    over = self_forcing_overrides(tmp_path, **{"method.chunk_size": 4, "training.data.data_path": latents})
    with pytest.raises(ConfigError) as err:
        build_from_config(SF_RECIPE, over)
    assert str(err.value) == (
        f"training.data.data_path '{latents}': self_forcing rolls out whole chunks: 6 latent frames is not a multiple of "
        "method.chunk_size 4 (set training.data.num_latent_t, or the clips' frame count, to a multiple)"
    )
    assert not (tmp_path / "out").exists()


def test_a_run_that_failed_at_its_first_step_leaves_a_folder_the_rerun_may_use(tmp_path, latents):
    from fv_accel.checkpoint import CheckpointError
    from fv_accel.output_dir import check_output_dir

    over = tiny_overrides(tmp_path, **{"training.data.data_path": latents, "training.loop.max_train_steps": 1,
                                       "training.tracker.trackers": ["tensorboard"]})
    failing = build_from_config(default_recipe("finetune"), over)

    def fail(batch, iteration):
        raise RuntimeError("a bad input found at the first step")

    failing.method.single_train_step = fail
    with pytest.raises(RuntimeError, match="first step"):
        Trainer(failing).run()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["logs"]
    assert not (out / "logs" / "metrics.jsonl").exists()
    rerun = build_from_config(default_recipe("finetune"), over)  # the corrected rerun, same folder
    assert Trainer(rerun).run()["steps"] == 1
    # A folder whose logs hold a step's metrics is another run's: refused as before.
    (tmp_path / "other" / "logs").mkdir(parents=True)
    (tmp_path / "other" / "logs" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(CheckpointError, match="already holds the outputs of another run"):
        check_output_dir(tmp_path / "other", None, overwrite=False)


# ---- R6.9: a LoRA run as a role's model ----
def test_a_lora_run_given_as_a_role_names_the_merge_command(tmp_path):
    """A LoRA run's output folder (its adapter and base_model.json, as a run writes them) as the
    teacher, and as the student: one line with the merge command and the folder it writes."""
    from safetensors.torch import save_file

    base = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"

    run = tmp_path / "lora_run"
    run.mkdir()
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 8)}, str(run / "pytorch_lora_weights.safetensors"))
    (run / "base_model.json").write_text(json.dumps({"family": "wan", "init_from": base, "subfolder": "transformer"}))
    teacher = {"models.student.transformer_config": dict(TINY_TEACHER), "models.critic.transformer_config": dict(TINY_TEACHER)}
    teacher.update({"models.teacher.init_from": str(run), "models.teacher.transformer_config": None})
    student = {"models.student.init_from": str(run), "models.student.transformer_config": None}
    for recipe, role, over in ((DMD2_RECIPE, "teacher", dmd2_overrides(tmp_path / "t", **teacher)),
                               (default_recipe("finetune"), "student", tiny_overrides(tmp_path / "s", **student))):
        with pytest.raises(ConfigError) as err:
            build_from_config(recipe, over)
        assert str(err.value) == (
            f"models.{role}.init_from '{run}' is a LoRA run (an adapter over '{base}'), not a model: merge it "
            f"into its base first (python -m fv_accel.export {run} --to merged) and give models.{role}.init_from the "
            f"folder that writes ({run / 'exports' / 'final_merged'})"
        )


# ---- R6.10: data_latent on prompts alone: the text-only refusal comes first ----
def test_data_latent_on_a_text_only_dataset_is_refused_as_such_before_the_batch_size(tmp_path):
    from test_text_only import _text_only_dataset

    data = _text_only_dataset(tmp_path / "prompts", [torch.ones(3, 32), torch.ones(4, 32)])
    over = {"training.data.data_path": str(data), "method.rollout_mode": "data_latent", "training.data.train_batch_size": 4}
    with pytest.raises(ConfigError) as err:  # 2 prompts for a batch of 4: the batch size would fail too
        build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path, **over))
    assert str(err.value) == (
        f"training.data.data_path '{data}' is a text-only dataset (prompts without video latents): method.rollout_mode "
        "data_latent needs video latents; use rollout_mode simulate or a dataset preprocessed from videos"
    )


# ---- R6.7 / R6.15: `inspect --check` checks the columns of the dataset's type; an unopenable file once, exit 2 ----
def test_inspect_check_passes_a_text_only_dataset(tmp_path, capsys):
    from test_text_only import _text_only_dataset

    from fv_accel.data.inspect import main as inspect_main

    data = _text_only_dataset(tmp_path / "prompts", [torch.ones(3, 32), torch.ones(4, 32)])
    assert inspect_main([str(data), "--check"]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert out.err == "" and lines[-1] == "check: 2 row(s) read, no problems"
    assert "latent channels: none (text-only); text width: 32" in lines
    assert "buckets: 1 (text-only: all 2 row(s); the rollout's shape is the recipe's)" in lines


def test_inspect_check_on_a_truncated_or_foreign_parquet_says_it_once_and_exits_2(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fv_accel.data.inspect import main as inspect_main
    from test_text_only import _text_only_dataset

    cut = _text_only_dataset(tmp_path / "cut", [torch.ones(3, 32)])
    shard = cut / "data-00000-of-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:3000])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    pq.write_table(pa.table({"a": [1, 2, 3]}), foreign / "data.parquet")
    unreadable = (f"{shard}: not a readable Parquet file (Parquet magic bytes not found in footer. Either the file is "
                  "corrupted or this is not a parquet file.); remove it, or rerun preprocessing to write it again")
    columns = ", ".join(f"{name}_{part}" for name in ("vae_latent", "text_embedding") for part in ("bytes", "shape", "dtype"))
    for path, message in ((cut, unreadable), (foreign, f"{foreign}: missing column(s) {columns}; expected FastVideo's "
                                                       f"schema ({columns})")):
        assert inspect_main([str(path), "--check"]) == 2, path
        out = capsys.readouterr()
        assert (out.out, out.err) == ("", f"error: {message}\n"), path
    # A second cut file is not in the open's line: the check names it, once; no row is at fault.
    second = cut / "data-00001-of-00002.parquet"
    second.write_bytes(shard.read_bytes())
    shard.rename(cut / "data-00000-of-00002.parquet")
    assert inspect_main([str(cut), "--check"]) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and str(cut / "data-00000-of-00002.parquet") in out.err
    assert out.out.splitlines() == ["check: 0 row(s) read; 1 problem(s):", "  " + unreadable.replace(str(shard), str(second))]
    # Only the second shard cut: the open's line names it, and the rows of the first are not called "no problems".
    readable = _text_only_dataset(tmp_path / "half", [torch.ones(3, 32), torch.ones(2, 32)])
    first = readable / "data-00000-of-00001.parquet"
    first.rename(readable / "data-00000-of-00002.parquet")
    (readable / "data-00001-of-00002.parquet").write_bytes(first.with_name("data-00000-of-00002.parquet").read_bytes()[:3000])
    assert inspect_main([str(readable), "--check"]) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and "data-00001-of-00002.parquet: not a readable Parquet file" in out.err
    assert out.out.splitlines() == ["check: 2 row(s) of the other file(s) read, no problem beyond the error above"]


# ---- R6.11: a binary file given as --prompts is refused as such ----
def test_an_mp4_given_as_prompts_is_refused_as_a_video_in_one_line(tmp_path, tiny_model_dir, capsys):
    import numpy as np

    from fv_accel.data.video import write_video
    from fv_accel.preprocess import EXPECTED_PROMPTS, main

    clip = write_video(tmp_path / "clip.mp4", np.zeros((5, 16, 16, 3), np.uint8))
    blob = tmp_path / "prompts.txt"
    blob.write_bytes(b"a red circle\n\x00\x01\x02")
    cases = [(clip, [], f"{clip}: a video or image file (.mp4), not text"),
             (clip, ["--caption_encoding", "latin-1"], f"{clip}: a video or image file (.mp4), not text"),
             (blob, [], f"{blob}: binary data (a NUL byte at offset 13), not text")]
    for path, extra, message in cases:
        argv = ["--model", str(tiny_model_dir), "--prompts", str(path), "--output", str(tmp_path / "out"), *extra]
        assert main(argv) == 2
        assert capsys.readouterr().err == f"error: {message}; {EXPECTED_PROMPTS}\n"
        assert not (tmp_path / "out").exists()


# ---- R6.12: preprocessing other input into a finished dataset's folder is refused ----
def test_other_prompts_or_clips_into_a_finished_dataset_are_refused(tmp_path, tiny_model_dir, capsys):
    import numpy as np
    import pyarrow.parquet as pq

    from fv_accel.data.video import write_video
    from fv_accel.preprocess import main

    def run(*source: str) -> int:
        return main(["--model", str(tiny_model_dir), *source, "--output", str(out), "--dtype", "float32",
                     "--num_frames", "5", "--buckets", "16x16"])

    def captions() -> list[str]:
        return [c for f in sorted(out.glob("data-*.parquet")) for c in pq.read_table(f).column("caption").to_pylist()]

    out = tmp_path / "data"
    (tmp_path / "three.txt").write_text("a red circle\na blue square\na green triangle\n")
    (tmp_path / "two.txt").write_text("a yellow star\na white ring\n")
    assert run("--prompts", str(tmp_path / "three.txt")) == 0
    before = captions()
    capsys.readouterr()
    assert run("--prompts", str(tmp_path / "two.txt")) == 2
    assert capsys.readouterr().err == (
        f"error: --output {out}: holds a 3-row text-only dataset (prompts) made from {tmp_path / 'three.txt'}; "
        f"preprocessing the prompts of {tmp_path / 'two.txt'} there would replace it: choose another --output, or "
        "remove the folder first\n"
    )
    clips = tmp_path / "clips"
    write_video(clips / "a.mp4", np.zeros((5, 16, 16, 3), np.uint8))
    (clips / "a.txt").write_text("a dark frame\n")
    assert run("--input", str(clips)) == 2
    assert "holds a 3-row text-only dataset (prompts)" in capsys.readouterr().err
    assert captions() == before and json.loads((out / "fv_dataset.json").read_text())["num_rows"] == 3
    # An edited copy of the same prompts shares rows with the dataset: it updates it.
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "three.txt").write_text("a red circle\na blue square\na green triangle\na black dot\n")
    assert run("--prompts", str(tmp_path / "copy" / "three.txt")) == 0
    assert captions() == [*before, "a black dot"]


# ---- R6.14: LTX-2 clips at two frame rates: preprocessing says so, the loader batches each audio length apart ----
def test_clips_at_two_frame_rates_are_named_and_batched_by_audio_length(tmp_path, tiny_model_of, caplog):
    import shutil

    from family_helpers import write_sound_clips

    from fv_accel.config import default_recipe, load_config
    from fv_accel.data.loader import build_train_loader
    from fv_accel.data.video import FrameSampling
    from fv_accel.preprocess import preprocess

    clips = tmp_path / "clips"
    write_sound_clips(clips)  # 8 fps: tone, silent, short
    fast = write_sound_clips(tmp_path / "at12", fps=12.0, num_frames=26)["tone"]
    shutil.copy(fast, clips / "fast.mp4")
    shutil.copy(fast.with_suffix(".txt"), clips / "fast.txt")
    sampling = FrameSampling(num_frames=(17,), buckets=((64, 64),), seed=0)
    with caplog.at_level("WARNING", logger="fv_accel.preprocess"):
        result = preprocess(str(tiny_model_of("ltx2")), str(clips), tmp_path / "data", sampling,
                            device=torch.device("cpu"), dtype=torch.float32)
    assert result.encoded == 4
    assert (
        "clips at 2 frame rates (8 fps: 3 clip(s), short.mp4, silent.mp4, tone.mp4; 12 fps: 1 clip(s), fast.mp4): the same "
        "frame count spans another time at each, so their sound latents differ in length and training batches each "
        "length apart; --target_fps samples every clip at one rate"
    ) in caplog.messages
    info = json.loads((tmp_path / "data" / "fv_dataset.json").read_text())
    assert info["audio"]["frame_rates"] == {"8": ["short.mp4", "silent.mp4", "tone.mp4"], "12": ["fast.mp4"]}
    # 17 frames: 53 audio latent frames at 8 fps, round(17 / 12 * 25) = 35 at 12 fps.
    cfg = load_config(default_recipe("finetune"), {"training.data.data_path": str(tmp_path / "data"),
                                                   "training.data.train_batch_size": 2, "training.data.text_max_length": 64})
    loader = build_train_loader(cfg, world_size=1, rank=0)
    assert sorted(set(loader.sampler.bucket_keys)) == [(3, 2, 2, 35), (3, 2, 2, 53)]
    batches = [batch for _, batch in zip(range(3), loader)]
    assert [tuple(b["audio_latent"].shape) for b in batches] == [(2, 2, 53, 4)] * 3
    assert all("fast.mp4" not in s for b in batches for s in b["source"])  # alone in its bucket: in no batch of 2
