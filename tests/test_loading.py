"""Loading the student (and the VAE / text encoder of the same repo) from a Hub id or a folder:
offline from the local cache, with revision/subfolder/variant/dtype, and clear errors otherwise."""

from __future__ import annotations

import shutil

import pytest
import torch

from fv_accel.config import StudentConfig, load_config, default_recipe
from fv_accel.models.loading import ModelLoadError, fetch_config, load_text_encoder, load_transformer, load_vae
from fv_accel.models.wan import CLASS_NAME_TO_KIND, TRANSFORMER_CLASSES

REPO_ID = "fv-accel-test/tiny-wan"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub_cache(tmp_path, tiny_model_dir, monkeypatch):
    """A Hugging Face cache holding the tiny model as `fv-accel-test/tiny-wan` (main = COMMIT),
    the layout `hf download` leaves; huggingface_hub is put offline and pointed at it."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / ("models--" + REPO_ID.replace("/", "--"))
    shutil.copytree(tiny_model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def _load(**kwargs):
    return load_transformer(StudentConfig(**kwargs), TRANSFORMER_CLASSES, CLASS_NAME_TO_KIND)


def test_uncached_hub_id_offline_names_the_id(offline_hub_cache):
    with pytest.raises(ModelLoadError) as err:
        _load(init_from="fv-accel-test/not-in-the-cache")
    message = str(err.value)
    assert "'fv-accel-test/not-in-the-cache'" in message
    assert "HF_HUB_OFFLINE" in message and "hf download fv-accel-test/not-in-the-cache" in message
    # The student role goes the same way (no stack trace from inside huggingface_hub).
    from fv_accel.models import build_student

    cfg = load_config(
        default_recipe("finetune"),
        {"models.student.init_from": "fv-accel-test/not-in-the-cache", "models.student.transformer_config": None},
    )
    with pytest.raises(ModelLoadError, match="fv-accel-test/not-in-the-cache"):
        build_student(cfg)


def test_cached_hub_id_loads_offline_with_its_vae_and_text_encoder(offline_hub_cache, tiny_model_dir):
    from diffusers import WanTransformer3DModel

    transformer = _load(init_from=REPO_ID, torch_dtype="bfloat16")
    reference = WanTransformer3DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    assert transformer.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert torch.equal(transformer.blocks[0].attn1.to_q.weight, reference.blocks[0].attn1.to_q.weight.bfloat16())
    # Pinned to the commit, too.
    assert _load(init_from=REPO_ID, revision=COMMIT).config.num_layers == reference.config.num_layers
    vae = load_vae(REPO_ID)
    assert type(vae).__name__ == "AutoencoderKLWan"
    assert fetch_config(REPO_ID, "vae")["latents_mean"] == list(vae.config.latents_mean)
    tokenizer, text_encoder = load_text_encoder(REPO_ID)
    ids = tokenizer(["a red ball"], return_tensors="pt").input_ids
    assert text_encoder(ids).last_hidden_state.shape[-1] == 32


def test_missing_revision_or_variant_is_named(offline_hub_cache):
    with pytest.raises(ModelLoadError, match=r"'fv-accel-test/tiny-wan' at revision 'v2'.*--revision v2"):
        _load(init_from=REPO_ID, revision="v2")
    # A variant that is not there is an error (never a fallback to pickled .bin weights).
    with pytest.raises(ModelLoadError, match=r"variant 'fp16'.*models.student.variant"):
        _load(init_from=REPO_ID, variant="fp16")


def test_local_folder_errors_name_the_folder(tmp_path, tiny_model_dir):
    with pytest.raises(ModelLoadError, match="has no nope/config.json"):
        _load(init_from=str(tiny_model_dir), subfolder="nope")
    with pytest.raises(ModelLoadError, match="AutoencoderKLWan.*not supported"):
        _load(init_from=str(tiny_model_dir), subfolder="vae")
    with pytest.raises(ModelLoadError, match="neither an existing local folder nor a valid Hub id"):
        _load(init_from=str(tmp_path / "does" / "not" / "exist"))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir / "transformer", broken / "transformer")
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=f"'{broken}'.*folder exists but has no loadable transformer"):
        _load(init_from=str(broken))


HUB_RECIPES = {
    # recipe: (Hub id, method, learning rate, frames, latent frames, validation every)
    "wan2_1_t2v_1_3b_sft": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "finetune", 1e-6, 77, 20, 100),
    "wan2_1_t2v_1_3b_lora": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "finetune", 1e-4, 77, 20, 100),
    "wan2_1_t2v_1_3b_dfsft": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "dfsft", 2e-6, 69, 18, 50),
    "skyreels_v2_df_1_3b_dfsft": ("Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers", "dfsft", 2e-6, 69, 18, 50),
}


@pytest.mark.parametrize("name", sorted(HUB_RECIPES))
def test_hub_recipes_carry_fastvideo_defaults(name):
    from fv_accel.config import CONFIG_DIR

    model_id, method, lr, frames, latent_t, every = HUB_RECIPES[name]
    cfg = load_config(CONFIG_DIR / f"{name}.yaml")
    assert cfg.models.student.init_from == model_id and cfg.models.student.transformer_config is None
    assert cfg.method.name == method and cfg.training.optimizer.learning_rate == lr
    assert cfg.training.optimizer.weight_decay == 0.01 and cfg.training.optimizer.betas == [0.9, 0.999]
    data = cfg.training.data
    assert (data.num_frames, data.num_latent_t, data.num_height, data.num_width) == (frames, latent_t, 448, 832)
    assert (data.num_frames - 1) // 4 + 1 == data.num_latent_t
    assert cfg.training.loop.max_train_steps == 4000 and cfg.models.student.flow_shift == 3.0
    assert cfg.callbacks.validation.every_steps == every and cfg.callbacks.grad_clip.max_grad_norm == 1.0
    assert cfg.models.student.lora.enable == name.endswith("_lora")
    if method == "dfsft":
        assert cfg.method.chunk_size == 3 and cfg.models.student.causal
        assert data.num_latent_t % cfg.method.chunk_size == 0
