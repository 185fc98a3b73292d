"""Context parallelism (`training.model.context_parallel`, fv_accel/models/context_parallel.py).

Here, in one process: the recipe keys, the layout and the refusals. The two-process runs (Ulysses 2
under DDP and FSDP2 against one process) share the launches of tests/test_distributed.py.
"""

from __future__ import annotations

import types

import pytest
import torch
from accelerate.utils import DistributedType
from diffusers import CosmosTransformer3DModel, WanTransformer3DModel

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


# ---- recipe keys ----


def test_context_parallel_is_off_by_default():
    cp = load_config(default_recipe("finetune")).training.model.context_parallel
    assert (cp.ulysses, cp.ring, cp.degree) == (1, 1, 1)
    cp = load_config(default_recipe("finetune"), {f"{CP}.ulysses": 2}).training.model.context_parallel
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


def test_causal_sample_videos_are_refused_under_context_parallel():
    load_config(default_recipe("finetune"), {f"{CP}.ulysses": 2})  # held-out loss and videos of a full-attention student
    with pytest.raises(ConfigError, match="'callbacks.validation.prompts': sample videos of a causal student"):
        load_config(default_recipe("dfsft"), {f"{CP}.ulysses": 2, "models.student.causal": True})
    load_config(default_recipe("dfsft"), {f"{CP}.ulysses": 2, "models.student.causal": True, "callbacks.validation.prompts": []})


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
    from fv_accel.models import FAMILIES, build_student
    from fv_accel.models.base import Capabilities

    cfg = load_config(
        default_recipe("finetune"),
        {f"{CP}.ulysses": 2, "training.checkpoint.output_dir": str(tmp_path / "out")},
    )
    student = build_student(cfg)
    acc = types.SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=2, is_main_process=True)
    with pytest.raises(ConfigError, match="runs under DDP or FSDP2, not DeepSpeed"):
        student.enable_context_parallel(acc, cfg.training.model.context_parallel)
    acc = types.SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1, is_main_process=True)
    with pytest.raises(ConfigError, match="needs 2 processes"):
        student.enable_context_parallel(acc, cfg.training.model.context_parallel)
    assert student.gradient_scale == 1.0
    # A family says whether it runs under context parallelism; only Wan's is validated.
    assert sorted(name for name, fam in FAMILIES.items() if fam.capabilities.context_parallel) == ["wan"]
    student.capabilities = Capabilities(per_frame_timesteps=True)
    acc = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2, is_main_process=True)
    with pytest.raises(ConfigError, match=r"the wan family \(WanTransformer3DModel\) does not run under context parallelism"):
        student.enable_context_parallel(acc, cfg.training.model.context_parallel)
