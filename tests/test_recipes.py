"""The real-model recipes: each resolves (unknown keys, types and ranges are checked by the config
layer) and `--dry-run` prints it, with the Hub id and the variant's keys as documented."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fv_accel.config import load_config

ROOT = Path(__file__).resolve().parents[1]

# recipe -> (Hub id, method, expert, task, LoRA, training shift)
WAN_RECIPES = {
    "wan2_1_t2v_1_3b_sft": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "finetune", None, "auto", False, 3.0),
    "wan2_1_t2v_1_3b_lora": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "finetune", None, "auto", True, 3.0),
    "wan2_1_t2v_1_3b_dfsft": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "dfsft", None, "auto", False, 3.0),
    "wan2_1_i2v_14b_480p_lora": ("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "finetune", None, "auto", True, 3.0),
    "wan2_2_ti2v_5b_sft": ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "finetune", None, "t2v", False, 5.0),
    "wan2_2_ti2v_5b_lora": ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "finetune", None, "i2v", True, 5.0),
    "wan2_2_ti2v_5b_dfsft": ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "dfsft", None, "t2v", False, 5.0),
    "wan2_2_t2v_a14b_lora_high_noise": ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "finetune", "high_noise", "auto", True, 12.0),
    "wan2_2_t2v_a14b_lora_low_noise": ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "finetune", "low_noise", "auto", True, 12.0),
    "wan2_2_i2v_a14b_lora_high_noise": ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "finetune", "high_noise", "auto", True, 5.0),
    "wan2_2_i2v_a14b_lora_low_noise": ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "finetune", "low_noise", "auto", True, 5.0),
    "skyreels_v2_df_1_3b_dfsft": ("Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers", "dfsft", None, "auto", False, 3.0),
    "wan2_1_t2v_1_3b_dmd2": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "dmd2", None, "auto", False, 3.0),
    "wan2_2_ti2v_5b_i2v_dmd2": ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "dmd2", None, "i2v", False, 5.0),
    # The student starts from the causal DFSFT run of wan2_1_t2v_1_3b_dfsft (the teacher is the Hub model).
    "wan2_1_t2v_1_3b_self_forcing": ("outputs/wan2_1_t2v_1_3b_dfsft", "self_forcing", None, "auto", False, 5.0),
    "wan2_1_t2v_1_3b_nft_image": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "diffusion_nft", None, "auto", False, 3.0),
    "wan2_1_t2v_1_3b_nft_lora": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "diffusion_nft", None, "auto", True, 3.0),
    # Teacher forcing, then causal consistency distillation from its run (the teacher and EMA the same run).
    "wan2_1_t2v_1_3b_tfsft": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "tfsft", None, "auto", False, 3.0),
    "wan2_1_t2v_1_3b_causal_cd": ("outputs/wan2_1_t2v_1_3b_tfsft", "causal_cd", None, "auto", False, 5.0),
    "wan2_1_t2v_1_3b_kd_causal": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "kd_causal", None, "auto", False, 5.0),
    "wan2_1_t2v_1_3b_anyflow_pretrain": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "anyflow_pretrain", None, "auto", False, 5.0),
    "wan2_1_t2v_1_3b_anyflow_onpolicy": ("outputs/wan2_1_t2v_1_3b_anyflow_pretrain", "anyflow", None, "auto", False, 5.0),
}


@pytest.mark.parametrize("name", sorted(WAN_RECIPES))
def test_recipe_resolves_with_its_variant_keys(name):
    repo, method, expert, task, lora, shift = WAN_RECIPES[name]
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    st = cfg.models.student
    assert (st.init_from, cfg.method.name, st.expert, st.task, st.lora.enable, st.flow_shift) == (
        repo, method, expert, task, lora, shift
    )
    assert cfg.training.checkpoint.output_dir == f"outputs/{name}"


# Recipes of the other families -> the family's test file, which dry-runs each of them.
FAMILY_RECIPES = {
    "hunyuan_video_lora": "test_family_hunyuan_video.py",
    "ltx_video_lora": "test_family_ltx_video.py",
    "ltx_video_0_9_5_lora": "test_family_ltx_video.py",
    "ltx_video_0_9_5_dfsft": "test_family_ltx_video.py",
    "cosmos2_2b_video2world_lora": "test_family_cosmos2.py",
    "cosmos2_2b_video2world_dfsft": "test_family_cosmos2.py",
    "hunyuan_video_15_480p_t2v_lora": "test_family_hunyuan_video_15.py",
    "hunyuan_video_15_480p_t2v_sft": "test_family_hunyuan_video_15.py",
    "ltx2_t2v_lora": "test_family_ltx2.py",
    "ltx2_t2av_lora": "test_family_ltx2.py",
    "ltx2_3_t2v": "test_family_ltx2.py",
    "ltx2_3_t2v_lora": "test_family_ltx2.py",
    "kandinsky5_t2v_lite_lora": "test_family_kandinsky5.py",
    "kandinsky5_t2v_lite_sft": "test_family_kandinsky5.py",
    "kandinsky5_t2v_lite_dmd2": "test_family_kandinsky5.py",
    "minimax_h3_t2va_lora": "test_family_minimax_h3.py",
}


def test_every_real_recipe_is_listed():
    real = {p.stem for p in (ROOT / "configs").glob("*.yaml")} - {
        "tiny_finetune", "tiny_dfsft", "tiny_dfsft_causal", "tiny_tfsft", "tiny_dmd2", "tiny_dmd2_teacher", "tiny_dfsft_causal_multimodal",
        "tiny_self_forcing", "tiny_nft", "bench_small", "gpu_bench_1_3b", "tiny_tfsft_multimodal", "tiny_causal_cd",
        "tiny_self_forcing_from_cd", "tiny_kd", "tiny_self_forcing_from_kd", "tiny_anyflow_pretrain", "tiny_anyflow",
        "gpu_bench_14b", "gpu_check_small",
    }
    assert real == set(WAN_RECIPES) | set(FAMILY_RECIPES)
    for name, test_file in FAMILY_RECIPES.items():
        assert name in (ROOT / "tests" / test_file).read_text(), f"{test_file} does not dry-run {name}"


@pytest.mark.parametrize("name", ["wan2_2_t2v_a14b_lora_low_noise", "wan2_2_ti2v_5b_dfsft", "wan2_1_i2v_14b_480p_lora", "wan2_1_t2v_1_3b_dmd2"])
def test_dry_run_prints_the_resolved_recipe(name, capsys, monkeypatch):
    """In process, as the entry scripts run it (tests/test_config.py launches one as a script)."""
    from fv_accel.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(WAN_RECIPES[name][1], ["--config", f"configs/{name}.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert "# memory estimate per process" in out  # offline: the repo's published architecture
    st = printed["models"]["student"]
    assert st["init_from"] == WAN_RECIPES[name][0]
    assert st["expert"] == WAN_RECIPES[name][2]


def test_the_dmd2_recipes_have_fastvideos_values():
    cfg = load_config(ROOT / "configs" / "wan2_1_t2v_1_3b_dmd2.yaml")
    m = cfg.method
    assert (m.dmd_denoising_steps, m.generator_update_interval, m.real_score_guidance_scale) == ([1000, 750, 500, 250], 5, 4.5)
    assert (m.fake_score_learning_rate, m.fake_score_betas, m.rollout_mode) == (8e-6, [0.0, 0.999], "simulate")
    for role in ("student", "teacher", "critic"):
        assert getattr(cfg.models, role).init_from == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert cfg.models.teacher.trainable is False
    ti2v = load_config(ROOT / "configs" / "wan2_2_ti2v_5b_i2v_dmd2.yaml")
    assert {getattr(ti2v.models, r).task for r in ("student", "teacher", "critic")} == {"i2v"}
