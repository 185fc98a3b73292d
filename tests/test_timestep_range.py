"""The timestep ratios bound FineTune's sampling (by rejection, so the density keeps its shape inside
the range) and DFSFT's; a Wan 2.2 expert trains only its side of the boundary, and a recipe range
outside it is refused naming both."""

from __future__ import annotations

import math

import pytest
import torch

from fv_accel.config import default_recipe, load_config
from fv_accel.methods import DiffusionForcingSFTMethod, FineTuneMethod
from fv_accel.models import WanStudent


def method_for(recipe: str, bounds=None, **overrides):
    cfg = load_config(default_recipe(recipe), overrides)
    torch.manual_seed(0)
    student = WanStudent(cfg)
    if bounds is not None:
        student.timestep_bounds = lambda: bounds
    cls = DiffusionForcingSFTMethod if recipe == "dfsft" else FineTuneMethod
    return cls(cfg=cfg, role_models={"student": student})


def draws(method, n=10_000, seed=0):
    return method.sample_homogeneous_indices(n, torch.Generator().manual_seed(seed), torch.device("cpu"))


def test_finetune_honours_the_timestep_ratios_over_10k_draws():
    m = method_for("finetune", **{"method.min_timestep_ratio": 0.2, "method.max_timestep_ratio": 0.6})
    idx = draws(m)
    assert m._timestep_index_range == (200, 601)
    assert int(idx.min()) >= 200 and int(idx.max()) <= 600
    # uniform density restricted to [200, 601): flat inside (each quarter holds ~25%), mean ~400
    assert abs(float(idx.float().mean()) - 400.0) < 5.0
    quarters = torch.histc(idx.float(), bins=4, min=200, max=601)
    assert ((quarters / idx.numel() - 0.25).abs() < 0.02).all(), quarters.tolist()


def test_rejection_keeps_the_logit_normal_shape_inside_the_range():
    over = {"training.model.weighting_scheme": "logit_normal"}
    free = draws(method_for("finetune", **over), n=40_000, seed=1)
    bounded = draws(method_for("finetune", **over, **{"method.min_timestep_ratio": 0.5}), n=10_000, seed=2)
    assert int(bounded.min()) >= 500
    inside = free[free >= 500].float()
    # the same conditional distribution: mean and quartiles agree within sampling noise
    assert abs(float(bounded.float().mean()) - float(inside.mean())) < 6.0
    for q in (0.25, 0.5, 0.75):
        assert abs(float(bounded.float().quantile(q)) - float(inside.quantile(q))) < 8.0


def test_default_ratios_draw_exactly_as_before():
    m = method_for("finetune")
    g = torch.Generator().manual_seed(3)
    expected = (torch.rand(64, generator=g) * 1000).long()
    assert torch.equal(draws(m, n=64, seed=3), expected)


def test_an_expert_range_becomes_the_sampling_range():
    # a high-noise expert of boundary_ratio 0.875: timesteps >= 875
    m = method_for("finetune", bounds=(875.0, math.inf))
    lo, hi = m._timestep_index_range
    t = m.table.timesteps
    assert lo == 0 and float(t[hi - 1]) >= 875.0 > float(t[hi])
    idx = draws(m)
    assert float(m.table.timesteps_at(idx).min()) >= 875.0
    low = method_for("dfsft", bounds=(-math.inf, 875.0))
    assert low._timestep_index_range == (hi, 1000)
    g = torch.Generator().manual_seed(0)
    chunk_idx = low.table.sample_chunk_indices(4, 6, 3, low._timestep_index_range, g, torch.device("cpu"))
    assert float(low.table.timesteps_at(chunk_idx).max()) < 875.0


def test_a_recipe_range_outside_the_experts_is_refused_naming_both():
    with pytest.raises(ValueError) as err:
        method_for("finetune", bounds=(875.0, math.inf), **{"method.max_timestep_ratio": 0.9})
    msg = str(err.value)
    assert "method.min_timestep_ratio/max_timestep_ratio 0.0/0.9" in msg
    assert "outside the student's range [0," in msg and "timesteps [875, inf)" in msg
