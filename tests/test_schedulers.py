"""The scheduler adapter against every check value of REFERENCE.md sections 1, 2 and 4."""

import math

import pytest
import torch

from fv_accel.schedulers import FlowMatchTable


@pytest.mark.parametrize(
    "shift, checks",
    [
        (3.0, {0: 1.0, 250: 0.9, 500: 0.75, 750: 0.5, 999: 0.002994}),
        (5.0, {0: 1.0, 250: 0.9375, 500: 0.8333, 750: 0.625, 999: 0.004980}),
    ],
)
def test_sigma_table_check_values(shift, checks):
    table = FlowMatchTable(shift)
    assert table.sigmas.shape == (1000,)
    for i, expected in checks.items():
        assert abs(float(table.sigmas[i]) - expected) < 1e-4, (shift, i)
        # t_i = N * sigma_i is what the transformer sees.
        assert abs(float(table.timesteps[i]) - 1000 * expected) < 1e-1


def test_sigma_table_matches_formula_everywhere():
    s, n = 3.0, 1000
    table = FlowMatchTable(s)
    u = (n - torch.arange(n, dtype=torch.float64)) / n
    sigma = s * u / (1 + (s - 1) * u)
    assert torch.allclose(table.sigmas.double(), sigma, atol=1e-6)
    assert bool((table.sigmas[1:] < table.sigmas[:-1]).all()), "the table must descend"


def test_add_noise_rectified_flow():
    table = FlowMatchTable(3.0)
    x0 = torch.randn(2, 4, 3, 2, 2)
    eps = torch.randn_like(x0)
    sigma = torch.tensor([0.25, 0.8])
    xt = table.add_noise(x0, eps, sigma)
    assert torch.allclose(xt[0], 0.75 * x0[0] + 0.25 * eps[0])
    assert torch.allclose(xt[1], 0.2 * x0[1] + 0.8 * eps[1])
    per_frame = torch.tensor([[0.1, 0.5, 0.9], [1.0, 0.0, 0.3]])
    xt = table.add_noise(x0, eps, per_frame)
    for b in range(2):
        for f in range(3):
            s = float(per_frame[b, f])
            assert torch.allclose(xt[b, :, f], (1 - s) * x0[b, :, f] + s * eps[b, :, f])


def test_homogeneous_uniform_sampling_uses_density_helper_and_floor():
    from diffusers.training_utils import compute_density_for_timestep_sampling

    table = FlowMatchTable(3.0)
    g1 = torch.Generator().manual_seed(7)
    idx = table.sample_homogeneous_indices(64, g1, torch.device("cpu"))
    g2 = torch.Generator().manual_seed(7)
    u = compute_density_for_timestep_sampling("uniform", 64, 0.0, 1.0, 1.0, device="cpu", generator=g2)
    assert torch.equal(idx, (u * 1000).long())
    assert idx.min() >= 0 and idx.max() <= 999


def test_logit_normal_positive_mean_favours_clean_samples():
    table = FlowMatchTable(3.0)
    g = torch.Generator().manual_seed(0)
    idx = table.sample_homogeneous_indices(4000, g, torch.device("cpu"), "logit_normal", logit_mean=1.5, logit_std=1.0)
    # u = sigmoid(n), n ~ N(1.5, 1): median index ~ 1000 * sigmoid(1.5) = 817 (larger u = less noise).
    median = float(idx.float().median())
    assert abs(median - 1000 * (1 / (1 + math.exp(-1.5)))) < 25
    assert float(table.sigmas_at(idx).mean()) < 0.5


def test_logit_std_zero_is_a_zero_not_a_default():
    table = FlowMatchTable(3.0)
    g = torch.Generator().manual_seed(0)
    idx = table.sample_homogeneous_indices(16, g, torch.device("cpu"), "logit_normal", logit_mean=0.0, logit_std=0.0)
    # std 0: every u is sigmoid(0) = 0.5 -> index 500.
    assert torch.equal(idx, torch.full((16,), 500))


def test_mode_sampling_runs_in_range():
    table = FlowMatchTable(3.0)
    g = torch.Generator().manual_seed(0)
    idx = table.sample_homogeneous_indices(256, g, torch.device("cpu"), "mode", mode_scale=1.0)
    assert idx.min() >= 0 and idx.max() <= 999


def test_per_sample_generators_give_per_sample_draws():
    table = FlowMatchTable(3.0)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    both = table.sample_homogeneous_indices(2, gens, torch.device("cpu"))
    alone = table.sample_homogeneous_indices(1, [torch.Generator().manual_seed(2)], torch.device("cpu"))
    assert int(both[1]) == int(alone[0])


def test_chunk_indices_are_constant_per_chunk_and_in_range():
    table = FlowMatchTable(3.0)
    g = torch.Generator().manual_seed(0)
    idx = table.sample_chunk_indices(4, 8, 3, (20, 981), g, torch.device("cpu"))
    assert idx.shape == (4, 8)
    for b in range(4):
        assert len(set(idx[b, 0:3].tolist())) == 1
        assert len(set(idx[b, 3:6].tolist())) == 1
        assert len(set(idx[b, 6:8].tolist())) == 1  # the last chunk is shorter
    assert idx.min() >= 20 and idx.max() <= 980


def test_dfsft_weight_check_values():
    w = FlowMatchTable(3.0).dfsft_weights("index")
    assert abs(float(w.mean()) - 1.0) < 1e-4
    assert float(w[0]) == 0.0
    for i, expected in {1: 0.00487, 999: 0.00487, 100: 0.4802, 900: 0.4802, 250: 1.1079, 750: 1.1079, 500: 1.5796}.items():
        assert abs(float(w[i]) - expected) < 1e-4, i
    x = torch.arange(1000, dtype=torch.float64)
    y = torch.exp(-2 * ((x - 500) / 1000) ** 2)
    assert abs(float((y - y.min()).sum()) - 249.09) < 1e-2


def test_dfsft_timestep_weighting_differs_from_index_except_at_shift_one():
    at_shift_one = FlowMatchTable(1.0)
    assert torch.allclose(at_shift_one.dfsft_weights("index"), at_shift_one.dfsft_weights("timestep"), atol=2e-3)
    shifted = FlowMatchTable(3.0)
    tw = shifted.dfsft_weights("timestep")
    assert abs(float(tw.mean()) - 1.0) < 1e-4
    assert not torch.allclose(shifted.dfsft_weights("index"), tw, atol=1e-2)
    with pytest.raises(ValueError, match="method.weighting"):
        shifted.dfsft_weights("bogus")
