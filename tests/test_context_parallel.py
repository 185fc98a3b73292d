"""Context parallelism (`training.model.context_parallel`, fv_accel/models/context_parallel.py).

The multi-process test launches 2 CPU processes (gloo, DDP) with Ulysses 2, so data parallel 1: both
processes train on the same samples, each holding half of every sequence, and must end where one
process ends on its own. The rest checks the recipe keys and the refusals, in one process.
"""

from __future__ import annotations

import types

import pytest
import torch
from accelerate.utils import DistributedType
from diffusers import CosmosTransformer3DModel, WanTransformer3DModel
from safetensors.torch import load_file

from fv_accel.config import ConfigError, ContextParallel, default_recipe, load_config
from fv_accel.models.context_parallel import (
    _token_count_check,
    causal_cp_plan,
    check_transformer,
    check_world_size,
    data_parallel_layout,
    describe_layout,
)
from fv_accel.tiny.cosmos2 import TINY_COSMOS2_TRANSFORMER_CONFIG
from fv_accel.tiny.model import tiny_transformer_config

CP = "training.model.context_parallel"
# The tiny recipes validate; validation does not run under context parallelism.
NO_VALIDATION = {"callbacks.validation.enable": False}


# ---- recipe keys ----


def test_context_parallel_is_off_by_default():
    cp = load_config(default_recipe("finetune")).training.model.context_parallel
    assert (cp.ulysses, cp.ring, cp.degree) == (1, 1, 1)
    cp = load_config(default_recipe("finetune"), {f"{CP}.ulysses": 2, **NO_VALIDATION}).training.model.context_parallel
    assert (cp.ulysses, cp.ring, cp.degree) == (2, 1, 2)


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("ulysses", 0, "context_parallel.ulysses': expected an integer >= 1, got 0"),
        ("ulysses", True, "context_parallel.ulysses': expected an integer, got True"),
        ("ring", -1, "context_parallel.ring': expected an integer >= 1, got -1"),
        ("ring", 2, "context_parallel.ring': 2: ring attention is not supported"),
    ],
)
def test_bad_context_parallel_keys_are_refused(key, value, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(default_recipe("finetune"), {f"{CP}.{key}": value})
    assert "\n" not in str(err.value)


def test_validation_is_refused_under_context_parallel():
    with pytest.raises(ConfigError, match="callbacks.validation.enable': true with training.model.context_parallel"):
        load_config(default_recipe("finetune"), {f"{CP}.ulysses": 2, "callbacks.validation.enable": True})


# ---- the layout ----


def test_layout_world_size_and_data_parallel_ranks():
    cp = ContextParallel(ulysses=2)
    check_world_size(cp, 4)
    with pytest.raises(ConfigError, match="ulysses 2 x ring 1 = 2 does not divide the 3 launched process"):
        check_world_size(cp, 3)
    # Consecutive ranks form a CP group and share a data-parallel rank.
    assert [data_parallel_layout(cp, 4, r) for r in range(4)] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert describe_layout(2, 1, 4) == "context parallel: ulysses 2 x ring 1 | data parallel 2"


def test_transformer_refusals():
    wan = WanTransformer3DModel(**tiny_transformer_config())
    check_transformer(wan, ContextParallel(ulysses=2))
    heads = wan.config.num_attention_heads
    with pytest.raises(ConfigError, match=f"ulysses: 3 does not divide the {heads} attention heads"):
        check_transformer(wan, ContextParallel(ulysses=3))
    cosmos = CosmosTransformer3DModel(**TINY_COSMOS2_TRANSFORMER_CONFIG)
    with pytest.raises(ConfigError, match="CosmosTransformer3DModel has no context-parallel plan"):
        check_transformer(cosmos, ContextParallel(ulysses=2))
    # The causal plan keeps the rotary tables whole and splits everything else as diffusers does.
    assert "rope" in wan._cp_plan and "rope" not in causal_cp_plan(wan)
    assert set(causal_cp_plan(wan)) == set(wan._cp_plan) - {"rope"}


def test_token_count_not_divisible_is_refused():
    wan = WanTransformer3DModel(**tiny_transformer_config())
    hook = _token_count_check(2)
    p_t, p_h, p_w = wan.config.patch_size
    hook(wan, (), {"hidden_states": torch.zeros(1, 4, 2 * p_t, 2 * p_h, p_w)})  # 4 tokens
    with pytest.raises(ValueError, match="3 latent tokens per clip do not split across 2 processes"):
        hook(wan, (), {"hidden_states": torch.zeros(1, 4, 3 * p_t, p_h, p_w)})


def test_student_refuses_deepspeed_and_one_process(tmp_path):
    from fv_accel.models import build_student

    cfg = load_config(
        default_recipe("finetune"),
        {f"{CP}.ulysses": 2, "training.checkpoint.output_dir": str(tmp_path / "out"), **NO_VALIDATION},
    )
    student = build_student(cfg)
    acc = types.SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=2, is_main_process=True)
    with pytest.raises(ConfigError, match="runs under DDP or FSDP2, not DeepSpeed"):
        student.enable_context_parallel(acc, cfg.training.model.context_parallel)
    acc = types.SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1, is_main_process=True)
    with pytest.raises(ConfigError, match="needs 2 processes"):
        student.enable_context_parallel(acc, cfg.training.model.context_parallel)
    assert student.gradient_scale == 1.0


# ---- two processes ----


@pytest.mark.multiproc
def test_ulysses_two_processes_equal_one_process(tmp_path, tiny_data_path):
    """Ulysses 2 on 2 processes (data parallel 1) == 1 process on the same samples: full SFT at batch 2
    with the per-rank noise generator, and block-causal DFSFT with LoRA at batch 1."""
    from tests.test_distributed import RECIPES, WEIGHT_TOL, _single_process, launch, max_diff, overrides

    runs = {
        "finetune": {"training.data.train_batch_size": 2, "training.loop.noise_rng": "rank"},
        "dfsft": {"training.data.train_batch_size": 1, "models.student.causal": True, "models.student.lora.enable": True},
    }
    cp = {f"{CP}.ulysses": 2}
    specs = [
        {"name": f"{m}_cp", "recipe": RECIPES[m], "engine": "launch", "overrides": overrides(tmp_path / f"{m}_cp", **extra, **cp)}
        for m, extra in runs.items()
    ]
    records = launch("accelerate_configs/cpu_2proc.yaml", specs, tmp_path)
    for method, extra in runs.items():
        ranks = records[f"{method}_cp"]
        assert [r["context_parallel"] for r in ranks] == [
            {"ulysses": 2, "ring": 1, "group_rank": 0}, {"ulysses": 2, "ring": 1, "group_rank": 1}
        ]
        one, w_one = _single_process(f"{method}_one", method, tmp_path, **extra)
        assert one["context_parallel"] is None
        folder = tmp_path / "records" / f"{method}_cp"
        w_rank0, w_rank1 = (load_file(str(folder / f"rank{r}.safetensors")) for r in (0, 1))
        assert max_diff(w_rank0, w_rank1) == 0.0
        assert max_diff(w_rank0, load_file(str(folder / "init.safetensors"))) > 1e-3  # it trained
        assert max_diff(w_rank0, w_one) < WEIGHT_TOL
        for step in range(len(one["steps"])):
            # Both processes of the CP group see the one-process samples, and its loss.
            samples = one["steps"][step]["samples"]
            assert ranks[0]["steps"][step]["samples"] == ranks[1]["steps"][step]["samples"] == samples
            for rank in ranks:
                assert rank["steps"][step]["local_loss"] == pytest.approx(one["steps"][step]["local_loss"], abs=1e-5)
                assert rank["logged"][step]["loss"] == pytest.approx(one["logged"][step]["loss"], abs=1e-5)
