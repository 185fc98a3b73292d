"""FineTuneMethod and DiffusionForcingSFTMethod: parsing, guards, losses, per-frame plumbing."""

import copy

import pytest
import torch

from fv_accel.config import default_recipe, load_config
from fv_accel.methods import DiffusionForcingSFTMethod, FineTuneMethod
from fv_accel.methods.fine_tuning.dfsft import parse_chunk_size, parse_timestep_index_range
from fv_accel.methods.fine_tuning.finetune import flow_matching_loss
from fv_accel.models import Capabilities, WanStudent
from fv_accel.schedulers import FlowMatchTable


def make_cfg(method="dfsft", **overrides):
    return load_config(default_recipe(method), overrides)


def make_method(method="dfsft", **overrides):
    cfg = make_cfg(method, **overrides)
    torch.manual_seed(0)
    student = WanStudent(cfg)
    cls = DiffusionForcingSFTMethod if cfg.method.name == "dfsft" else FineTuneMethod
    return cls(cfg=cfg, role_models={"student": student})


def fake_batch(b=2, t=6, h=6, w=6, c=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "vae_latent": torch.randn(b, c, t, h, w, generator=g),
        "text_embedding": torch.randn(b, 512, 32, generator=g),
        "text_attention_mask": torch.ones(b, 512, dtype=torch.long),
        "sample_index": torch.arange(b),
        "epoch": torch.zeros(b, dtype=torch.long),
    }


# ---- DFSFT parsing (REFERENCE.md section 4) ----


def test_chunk_size_parsing_accepts():
    assert parse_chunk_size(None) == 3
    assert parse_chunk_size(1) == 1
    assert parse_chunk_size(4.0) == 4
    assert parse_chunk_size(" 5 ") == 5


@pytest.mark.parametrize("bad", [True, False, 2.5, "", "   ", "three", 0, -1, "0", [3], 1.5])
def test_chunk_size_parse_errors_name_the_key(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        parse_chunk_size(bad)


def test_timestep_index_range_defaults_and_example():
    assert parse_timestep_index_range(0.0, 1.0) == (0, 1000)
    assert parse_timestep_index_range(None, None) == (0, 1000)
    assert parse_timestep_index_range(0.02, 0.98) == (20, 981)
    assert parse_timestep_index_range("0.02", "0.98") == (20, 981)
    # hi <= lo is widened by one index
    assert parse_timestep_index_range(0.5, 0.5) == (500, 502)
    assert parse_timestep_index_range(1.0, 1.0) == (999, 1000)


@pytest.mark.parametrize(
    "lo, hi, key",
    [
        (True, 1.0, "min_timestep_ratio"),
        (0.0, False, "max_timestep_ratio"),
        (-0.1, 1.0, "min_timestep_ratio"),
        (0.0, 1.5, "max_timestep_ratio"),
        ("abc", 1.0, "min_timestep_ratio"),
        (0.0, "", "max_timestep_ratio"),
        (0.8, 0.2, "max_timestep_ratio"),
        ([0.1], 1.0, "min_timestep_ratio"),
    ],
)
def test_timestep_range_parse_errors_name_the_key(lo, hi, key):
    with pytest.raises(ValueError, match=key):
        parse_timestep_index_range(lo, hi)


def test_dfsft_constructor_exposes_seed_attributes():
    m = make_method("dfsft", **{"method.chunk_size": 2, "method.min_timestep_ratio": 0.02, "method.max_timestep_ratio": 0.98})
    assert m._chunk_size == 2
    assert m._timestep_index_range == (20, 981)
    assert m._attn_kind == "dense"
    assert m._training_weights.shape == (1000,)
    assert abs(float(m._training_weights[500]) - 1.5796) < 1e-4


def test_dfsft_constructor_rejects_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        make_method("dfsft", **{"method.chunk_size": "x"})


def test_methods_require_trainable_student():
    cfg = make_cfg("dfsft")
    student = WanStudent(cfg)
    student._trainable = False
    with pytest.raises(ValueError, match="trainable"):
        DiffusionForcingSFTMethod(cfg=cfg, role_models={"student": student})
    with pytest.raises(ValueError, match="student"):
        FineTuneMethod(cfg=cfg, role_models={})


def test_dfsft_refuses_a_student_without_per_frame_timesteps():
    cfg = make_cfg("dfsft")
    student = WanStudent(cfg)
    # e.g. HunyuanVideo / CogVideoX: [B] only
    student.capabilities = Capabilities(per_frame_timesteps=False, causal_attention=True)
    with pytest.raises(ValueError, match="the wan family cannot take a timestep per latent frame: its transformer takes one"):
        DiffusionForcingSFTMethod(cfg=cfg, role_models={"student": student})


def test_dfsft_refuses_a_causal_block_size_different_from_chunk_size():
    cfg = make_cfg("dfsft", **{"method.chunk_size": 3})
    student = WanStudent(cfg)
    student.causal_block_size = 2
    with pytest.raises(ValueError, match="causal block size"):
        DiffusionForcingSFTMethod(cfg=cfg, role_models={"student": student})


# ---- losses against a hand computation ----


def _fixed_tensors():
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 3, 4, 2, 2, generator=g)
    eps = torch.randn(2, 3, 4, 2, 2, generator=g)
    pred = torch.randn(2, 3, 4, 2, 2, generator=g)
    return x0, eps, pred


def test_finetune_loss_velocity_by_hand():
    x0, eps, pred = _fixed_tensors()
    sigma = torch.tensor([0.3, 0.9])
    xt = FlowMatchTable(3.0).add_noise(x0, eps, sigma)
    loss = flow_matching_loss(pred, x0, xt, eps, sigma, precondition_outputs=False)
    total, count = 0.0, 0
    for v_hat, e, x in zip(pred.flatten().tolist(), eps.flatten().tolist(), x0.flatten().tolist()):
        total += (v_hat - (e - x)) ** 2
        count += 1
    assert abs(float(loss) - total / count) < 1e-5
    assert loss.dtype == torch.float32


def test_finetune_loss_preconditioned_by_hand_equals_sigma_squared_weighting():
    x0, eps, pred = _fixed_tensors()
    sigma = torch.tensor([0.3, 0.9])
    xt = FlowMatchTable(3.0).add_noise(x0, eps, sigma)
    loss = flow_matching_loss(pred, x0, xt, eps, sigma, precondition_outputs=True)
    hand = 0.0
    for b in range(2):
        s = float(sigma[b])
        hand += float(((xt[b] - s * pred[b] - x0[b]) ** 2).sum())
    hand /= pred.numel()
    assert abs(float(loss) - hand) < 1e-5
    # equal to the velocity MSE weighted by sigma^2 per sample
    per_sample = ((pred - (eps - x0)) ** 2).mean(dim=(1, 2, 3, 4))
    assert abs(float(loss) - float((per_sample * sigma**2).mean())) < 1e-5


@pytest.mark.parametrize("precondition", [False, True])
def test_dfsft_loss_by_hand(precondition):
    m = make_method("dfsft", **{"training.model.precondition_outputs": precondition, "method.chunk_size": 2})
    batch = fake_batch(b=2, t=4, h=4, w=4)
    loss_map, outputs, _ = m.single_train_step(batch, 0)
    tb = outputs["training_batch"]
    with torch.no_grad():
        pred = m.student.predict_noise(tb.latents, tb.timesteps, tb)
    w = FlowMatchTable(3.0).dfsft_weights("index")
    hand = 0.0
    for b in range(2):
        for f in range(4):
            s = float(tb.sigmas[b, f])
            if precondition:
                err = tb.noisy_model_input[b, :, f] - s * pred[b, :, f] - tb.latents[b, :, f]
            else:
                err = pred[b, :, f] - (tb.noise[b, :, f] - tb.latents[b, :, f])
            hand += float((err.double() ** 2).mean()) * float(w[int(tb.timestep_indices[b, f])])
    hand /= 8
    assert set(loss_map) == {"total_loss", "dfsft_loss"}
    assert abs(float(loss_map["total_loss"]) - hand) < 1e-4 * max(1.0, abs(hand))


def test_finetune_loss_map_keys():
    m = make_method("finetune")
    loss_map, outputs, metrics = m.single_train_step(fake_batch(), 0)
    assert set(loss_map) == {"total_loss", "finetune_loss"}
    assert loss_map["total_loss"] is loss_map["finetune_loss"]
    assert outputs["training_batch"].timesteps.shape == (2,)


# ---- per-frame plumbing ----


def test_dfsft_batch_carries_chunk_constant_per_frame_timesteps():
    m = make_method("dfsft", **{"method.chunk_size": 2})
    _, outputs, _ = m.single_train_step(fake_batch(b=3, t=5), 0)
    tb = outputs["training_batch"]
    assert tb.timesteps.shape == (3, 5)
    assert tb.sigmas.shape == (3, 5)
    for b in range(3):
        assert tb.timesteps[b, 0] == tb.timesteps[b, 1]
        assert tb.timesteps[b, 2] == tb.timesteps[b, 3]
    # independent chunks: over 3 samples x 3 chunks, not all levels can be equal
    assert len(set(tb.timesteps.flatten().tolist())) > 1
    # per-frame noising
    s = tb.sigmas[:, None, :, None, None]
    assert torch.allclose(tb.noisy_model_input, (1 - s) * tb.latents + s * tb.noise)


def test_draw_order_noise_then_u_then_chunk_indices():
    m = make_method("dfsft", **{"method.chunk_size": 3})
    batch = fake_batch(b=2, t=6)
    _, outputs, _ = m.single_train_step(batch, 0)
    tb = outputs["training_batch"]
    g = torch.Generator().manual_seed(0)  # seed 0 + rank 0
    noise = torch.randn(2, 16, 6, 6, 6, generator=g)
    torch.rand(2, generator=g)  # the homogeneous u, drawn then discarded
    idx_chunk = torch.randint(0, 1000, (2, 2), generator=g)
    assert torch.equal(tb.noise, noise)
    assert torch.equal(tb.timestep_indices, idx_chunk.repeat_interleave(3, dim=1))


@pytest.mark.parametrize("model_class", ["wan", "skyreels_v2"])
def test_equal_per_frame_timesteps_match_scalar_timestep(model_class):
    cfg = make_cfg("dfsft", **{"models.student.model_class": model_class})
    torch.manual_seed(0)
    student = WanStudent(cfg)
    student.init_preprocessors(cfg.training)
    student.transformer.eval()
    batch = fake_batch(b=2, t=4, h=4, w=4)
    tb = student.prepare_batch(batch, generator=torch.Generator().manual_seed(0))
    scalar = torch.tensor([400.0, 730.0])
    per_frame = scalar[:, None].expand(2, 4).contiguous()
    with torch.no_grad():
        a = student.predict_noise(tb.latents, scalar, tb)
        b = student.predict_noise(tb.latents, per_frame, tb)
    assert a.shape == (2, 16, 4, 4, 4)
    assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())
    # and different per-frame timesteps do change the prediction
    varied = per_frame.clone()
    varied[:, -1] = 10.0
    with torch.no_grad():
        c = student.predict_noise(tb.latents, varied, tb)
    assert not torch.allclose(a, c, atol=1e-4)


def test_per_frame_timesteps_of_wrong_shape_are_rejected():
    cfg = make_cfg("dfsft")
    student = WanStudent(cfg)
    student.init_preprocessors(cfg.training)
    tb = student.prepare_batch(fake_batch(b=1, t=4, h=4, w=4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="per-frame timesteps"):
        student.predict_noise(tb.latents, torch.zeros(1, 3), tb)


def test_latent_normalisation_uses_recipe_statistics():
    mean = [float(i) for i in range(16)]
    std = [2.0] * 16
    cfg = make_cfg("finetune", **{"models.student.latents_mean": mean, "models.student.latents_std": std})
    student = WanStudent(cfg)
    student.init_preprocessors(cfg.training)
    batch = fake_batch(b=1, t=2, h=2, w=2)
    tb = student.prepare_batch(copy.deepcopy(batch), generator=torch.Generator().manual_seed(0))
    expected = (batch["vae_latent"] - torch.tensor(mean).view(1, -1, 1, 1, 1)) / 2.0
    assert torch.allclose(tb.latents, expected)


def test_latent_channel_mismatch_is_a_clear_error():
    cfg = make_cfg("finetune")
    student = WanStudent(cfg)
    student.init_preprocessors(cfg.training)
    with pytest.raises(ValueError, match="channels"):
        student.prepare_batch(fake_batch(c=4), generator=torch.Generator().manual_seed(0))
