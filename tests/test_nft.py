"""DiffusionNFT (method.name diffusion_nft) in the trainer's one loop: a run stopped between two
optimizer steps of an outer step resumes bitwise, a reward that returns NaN for one sample drops
that sample from its group, and what cannot run is refused in one line naming the key."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

from dmd2_helpers import TINY_TEACHER
from fv_accel.build import build_from_config
from fv_accel.config import ConfigError, default_recipe, micro_batches_per_step
from fv_accel.trainer import Trainer

NFT_RECIPE = str(default_recipe("diffusion_nft"))


def nft_overrides(tmp_path: Path, data_path: str, **extra) -> dict:
    """configs/tiny_nft.yaml at test scale: a one-block inline student (old and reference take its
    weights), 2 sampling batches of 2 videos of one prompt, 2 sampling steps, both trained
    (timestep_fraction 1), micro-batches of 2: two optimizer steps per outer step."""
    out = {
        "models.student.init_from": None,
        "models.student.transformer_config": dict(TINY_TEACHER),
        "method.sampling.num_steps": 2,
        "method.timestep_fraction": 1.0,
        "method.sample_train_batch_size": 2,
        "method.num_video_per_prompt": 2,
        "method.num_batches_per_epoch": 2,
        "method.train_batch_size": 2,
        "method.validation.every_steps": 0,
        "method.validation.prompts": [],
        "training.data.data_path": data_path,
        "training.data.train_batch_size": 2,
        "training.data.text_max_length": 16,
        "training.loop.max_train_steps": 6,
        "training.optimizer.learning_rate": 1e-3,
        "training.checkpoint.output_dir": str(tmp_path / "out"),
        "training.checkpoint.training_state_checkpointing_steps": 0,
        "training.checkpoint.save_final": False,
        "training.tracker.trackers": ["none"],
        "training.tracker.write_plots": False,
        "callbacks.validation.enable": False,
    }
    out.update(extra)
    return out


def test_an_optimizer_step_accumulates_every_trained_timestep(tmp_path, tiny_data_path):
    from fv_accel.config import load_config

    cfg = load_config(NFT_RECIPE, nft_overrides(tmp_path, tiny_data_path, **{"training.loop.gradient_accumulation_steps": 2}))
    assert micro_batches_per_step(cfg) == 4
    # Shift 3, 4 steps: 1000, 857.7, 602.2, 8.93; timestep_fraction 0.99 drops the last.
    cfg = load_config(NFT_RECIPE, nft_overrides(tmp_path, tiny_data_path, **{
        "method.sampling.num_steps": 4, "method.timestep_fraction": 0.99}))
    assert micro_batches_per_step(cfg) == 3


def test_the_sampling_schedule_is_shifted_twice_at_its_low_end():
    from fv_accel.config import NFTSamplingConfig
    from fv_accel.methods.rl.sampling import sampling_schedule

    s = sampling_schedule(3.0, NFTSamplingConfig(num_steps=4), torch.device("cpu"))
    assert s.timesteps.tolist() == pytest.approx([1000.0, 857.69, 602.15, 8.93], abs=0.01)
    assert s.sigmas[-1].item() == 0.0 and len(s.sigmas) == 5


@pytest.mark.parametrize("lora,noise_rng", [(False, "rank"), (True, "rank"), (False, "sample")], ids=["full", "lora", "per_sample"])
def test_stopped_between_optimizer_steps_of_an_outer_step_resumes_bitwise(tmp_path, tiny_data_path, lora, noise_rng):
    common = {"training.checkpoint.training_state_checkpointing_steps": 3, "models.student.lora.enable": lora,
              "training.loop.noise_rng": noise_rng, "training.loop.max_train_steps": 4}
    straight = build_from_config(NFT_RECIPE, nft_overrides(tmp_path / "a", tiny_data_path, **common))
    assert straight.method.steps_per_outer == 2
    start = [o.detach().clone() for _, o in straight.method.old_pairs()]
    Trainer(straight).run()
    first = build_from_config(NFT_RECIPE, nft_overrides(tmp_path / "b", tiny_data_path, **{**common, "training.loop.max_train_steps": 3}))
    Trainer(first).run()
    assert first.method.outer is not None and first.method.outer.iteration == 2  # stopped inside outer step 2
    resumed = build_from_config(NFT_RECIPE, nft_overrides(tmp_path / "b", tiny_data_path, **common, **{
        "training.checkpoint.resume_from_checkpoint": "latest"}))
    assert resumed.start_step == 3
    Trainer(resumed).run()
    for role in ("student", "old"):
        a = getattr(straight.method, role).transformer.state_dict()
        b = getattr(resumed.method, role).transformer.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (role, k)
    for (s1, o1), (s2, o2) in zip(straight.method.old_pairs(), resumed.method.old_pairs()):
        assert torch.equal(s1, s2) and torch.equal(o1, o2)
    assert torch.equal(straight.method.cuda_generator.get_state(), resumed.method.cuda_generator.get_state())
    # The old policy moved toward the student (decay_type 1: it keeps 0.1% then 0.2% of itself).
    assert any(not torch.equal(o, s) for (_, o), s in zip(straight.method.old_pairs(), start))


def test_a_nan_reward_drops_its_sample_from_the_group_and_is_named_once(tmp_path, tiny_data_path, monkeypatch, caplog):
    module = tmp_path / "nan_rewards.py"
    module.write_text(textwrap.dedent("""
        import torch
        CALLS = []
        def brightness(clips, prompts):
            CALLS.append(len(prompts))
            r = clips.float().mean(dim=(1, 2, 3, 4)) / 255.0
            r[0] = float("nan")
            return r
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    run = build_from_config(NFT_RECIPE, nft_overrides(tmp_path, tiny_data_path, **{
        "method.reward_fn": [{"name": "nan_rewards:brightness", "weight": 1.0}], "training.loop.max_train_steps": 2}))
    trainer = Trainer(run)
    with caplog.at_level("WARNING"):
        trainer.run()
    import nan_rewards

    assert nan_rewards.CALLS == [2, 2]
    # One warning per reward, naming the prompt, though both sampling batches had a NaN.
    named = [r for r in caplog.records if "nan_rewards:brightness" in r.getMessage()]
    assert len(named) == 1
    # Each sampling batch's first sample is dropped: 2 of the outer step's 4, and the advantages of the
    # others are finite (their groups computed without it); the dropped ones carry advantage 0.
    logged = [h for h in trainer.history if "reward/dropped" in h]
    assert logged and all(h["reward/dropped"] == 2 for h in logged)
    assert all(math.isfinite(h["advantage/std"]) and math.isfinite(h["loss"]) for h in logged)


def test_refusals_are_one_line_naming_the_key(tmp_path, tiny_data_path):
    cases = [
        ({"models.student.lora.enable": True, "models.old.init_from": "x"}, "models.old"),
        ({"method.num_video_per_prompt": 3}, "method.num_video_per_prompt"),
        ({"training.loop.gradient_accumulation_steps": 3}, "training.loop.gradient_accumulation_steps"),
        ({"method.timestep_fraction": 0.0}, "method.timestep_fraction"),
        ({"method.reward_fn": {"no_such_reward": 1.0}}, "method.reward_fn"),
        ({"models.teacher.init_from": "x"}, "models.teacher"),
    ]
    for extra, key in cases:
        with pytest.raises((ConfigError, ValueError)) as err:
            run = build_from_config(NFT_RECIPE, nft_overrides(tmp_path / str(abs(hash(key))), tiny_data_path, **extra))
            Trainer(run).run()
        text = str(err.value)
        assert key in text and "\n" not in text, (extra, text)


def test_a_lora_run_holds_one_base_with_the_old_policy_an_adapter_and_the_reference_the_base(tmp_path, tiny_data_path):
    run = build_from_config(NFT_RECIPE, nft_overrides(tmp_path, tiny_data_path, **{
        "models.student.lora.enable": True, "models.student.lora.rank": 4, "training.loop.max_train_steps": 2}))
    method = run.method
    assert run.config.models.old is None and run.config.models.reference is None
    transformer = method.student.transformer
    assert method.old.transformer is transformer and method.reference.transformer is transformer
    base = [p for n, p in transformer.named_parameters() if "lora_" not in n]
    assert len({p.data_ptr() for p in base}) == len(base)  # each base weight stored once, in the one transformer
    trained = [n for n, p in transformer.named_parameters() if p.requires_grad]
    assert trained and all(".default." in n for n in trained)
    old_adapter = [n for n, _ in transformer.named_parameters() if ".old." in n]
    assert len(old_adapter) == len(trained)
    Trainer(run).run()
    # After the outer step the old adapter is decay * itself + (1 - decay) * the student's (decay 0.001).
    for student, old in method.old_pairs():
        assert torch.allclose(old, student.detach(), atol=1e-3 * float((student.detach()).abs().max()) + 1e-7)
    moved = [(s, o) for s, o in method.old_pairs() if not torch.equal(s, o)]
    assert moved, "the LoRA B matrices trained: the old adapter must differ from the student's in the last bits"
    # The reference is the base: its prediction equals the student's with every adapter off.
    from fv_accel.models.base import TrainingBatch
    from fv_accel.models.lora import adapter_view

    x = torch.randn(1, 16, 3, 4, 4)
    cond = method.outer.cond.select(torch.tensor([0])) if method.outer is not None else None
    if cond is None:
        batch, _ = method.prompt_batch(1, 0)
        cond = method.student.build_conditioning(batch).select(torch.tensor([0]))
    tb = TrainingBatch(conditioning=cond)
    t = torch.tensor([500.0])
    with torch.no_grad():
        ref = method.reference.predict_noise(x, t, tb)
        with adapter_view(transformer, None):
            base_pred = method.student.predict_noise(x, t, tb)
        student_pred = method.student.predict_noise(x, t, tb)
    assert torch.equal(ref, base_pred)
    assert not torch.equal(ref, student_pred)
    assert all(".default." in n for n, p in transformer.named_parameters() if p.requires_grad)  # views left grads alone


def test_the_memory_estimate_counts_three_copies_in_full_and_one_base_with_lora(tmp_path, tiny_data_path):
    from fv_accel.config import load_config
    from fv_accel.memory_estimate import estimate_memory

    env = {"WORLD_SIZE": "1"}
    sft = estimate_memory(load_config(default_recipe("finetune"), {
        "models.student.transformer_config": dict(TINY_TEACHER), "training.data.data_path": tiny_data_path}), env)
    full = estimate_memory(load_config(NFT_RECIPE, nft_overrides(tmp_path, tiny_data_path)), env)
    lora = estimate_memory(load_config(NFT_RECIPE, nft_overrides(tmp_path, tiny_data_path, **{"models.student.lora.enable": True})), env)
    assert full.parameters == pytest.approx(3 * sft.parameters)
    adapter = lora.census.trainable_bytes
    assert adapter > 0 and lora.parameters == pytest.approx(lora.census.param_bytes + adapter)
    assert any("one base" in n for n in lora.notes) and any("two frozen copies" in n for n in full.notes)


def test_the_memory_estimate_counts_a_reward_model_from_its_config(tmp_path, tiny_data_path):
    from transformers import CLIPModel

    from fv_accel.config import load_config
    from fv_accel.memory_estimate import estimate_memory
    from fv_accel.tiny.clip import write_tiny_clip

    folder = write_tiny_clip(tmp_path / "clip", kind="clip")
    count = sum(p.numel() for p in CLIPModel.from_pretrained(str(folder)).parameters())
    cfg = load_config(NFT_RECIPE, nft_overrides(tmp_path, tiny_data_path, **{
        "method.reward_fn": [{"name": "clipscore", "model": str(folder)}, {"name": "tiny_left"}]}))
    note = [n for n in estimate_memory(cfg, {"WORLD_SIZE": "1"}).notes if "rewards:" in n][0]
    assert f"clipscore {folder}: {count:,} parameters" in note and "tiny_left: no model" in note


def test_the_sample_watch_warns_on_both_sides_of_the_reference_in_one_line(tmp_path, tiny_data_path, caplog):
    from fv_accel.config import load_config
    from fv_accel.reward_validation import RewardValidationCallback

    cfg = load_config(NFT_RECIPE, nft_overrides(tmp_path, tiny_data_path, **{"callbacks.validation.stop_on_collapse": True}))
    watch = RewardValidationCallback(cfg)
    watch.reference = {"temporal_variation": 0.010, "colour_spread": 0.070}
    stops = []

    class Run:
        def request_stop(self, reason):
            stops.append(reason)

    cases = [({"temporal_variation": 0.011, "colour_spread": 0.05}, None),
             ({"temporal_variation": 0.030, "colour_spread": 0.07}, "diverging"),
             ({"temporal_variation": 0.010, "colour_spread": 0.02}, "collapsing")]
    for figures, expected in cases:
        caplog.clear()
        with caplog.at_level("WARNING"):
            watch.watch(Run(), 8, figures)
        lines = [r.getMessage() for r in caplog.records]
        if expected is None:
            assert not lines
            continue
        assert len(lines) == 1 and "\n" not in lines[0] and expected in lines[0] and "step 8" in lines[0]
    assert "temporal variation 0.0300, above the reference's 0.0100 / 0.5" in stops[0]
    assert "colour spread 0.0200, below 0.5 x the reference's 0.0700" in stops[1]
    # The figure inside the band is named beside the one outside it.
    assert "colour spread 0.0700, equal to the reference's 0.0700 (1.00 x, inside the band)" in stops[0]
    assert "temporal variation 0.0100, equal to the reference's 0.0100" in stops[1]


def test_the_sample_watch_line_names_both_figures_and_a_mixed_verdict():
    from fv_accel.validation import sample_watch_message

    teacher = {"temporal_variation": 0.0030, "colour_spread": 0.0701}
    line = sample_watch_message(50, "the student's samples", {"temporal_variation": 0.0056, "colour_spread": 0.3897},
                                teacher, "the teacher's", 0.5)
    assert line == ("step 50: the student's samples are diverging (flicker, noise): temporal variation 0.0056, above the "
                    "teacher's 0.0030 (1.87 x, inside the band); colour spread 0.3897, above the teacher's 0.0701 / 0.5 "
                    "(callbacks.validation.collapse_ratio)")
    mixed = sample_watch_message(7, "s", {"temporal_variation": 0.0001, "colour_spread": 0.3}, teacher, "t", 0.5)
    assert mixed.startswith("step 7: s are collapsing and diverging (one figure below, one above): temporal variation "
                            "0.0001, below 0.5 x t 0.0030; colour spread 0.3000, above t 0.0701 / 0.5")
    assert sample_watch_message(7, "s", {"temporal_variation": 0.004, "colour_spread": 0.05}, teacher, "t", 0.5) is None
    assert sample_watch_message(7, "s", {"temporal_variation": float("nan"), "colour_spread": 0.05}, teacher, "t", 0.5) is None
