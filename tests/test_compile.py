"""training.model.compile: blocks (diffusers' regional compilation of the repeated transformer
blocks): the same losses and gradients as eager, one compilation for every step of a bucket shape,
and a one-line refusal for a transformer without repeated blocks.

The runs compile with the aot_eager backend: Dynamo's tracing and AOTAutograd's joint forward and
backward graphs, the parts that decide graph breaks, recompiles and gradients, without Inductor's
C++ code generation (minutes on a CPU). Inductor itself is measured by benchmarks, not here."""

from __future__ import annotations

import pytest
import torch

from fv_accel.build import build_from_config
from fv_accel.config import default_recipe
from fv_accel.trainer import Trainer, TrainerCallback
from tests.conftest import tiny_overrides


@pytest.fixture
def aot_eager_blocks(monkeypatch):
    """compile_repeated_blocks with backend aot_eager, counting the block graphs Dynamo builds."""
    from diffusers.models.modeling_utils import ModelMixin
    from torch._dynamo.utils import counters

    compile_repeated_blocks = ModelMixin.compile_repeated_blocks

    def with_aot_eager(self, *args, **kwargs):
        return compile_repeated_blocks(self, *args, backend="aot_eager", **kwargs)

    monkeypatch.setattr(ModelMixin, "compile_repeated_blocks", with_aot_eager)
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def run_three_steps(tmp_path, compile_mode: str):
    """(losses, gradients per step by parameter name, Dynamo graphs compiled so far after each step)."""
    from accelerate.state import AcceleratorState, GradientState
    from torch._dynamo.utils import counters

    overrides = tiny_overrides(
        tmp_path / compile_mode,
        **{
            "training.loop.max_train_steps": 3,
            "training.checkpoint.save_final": False,
            "training.model.compile": compile_mode,
            "training.data.train_batch_size": 1,
        },
    )
    run = build_from_config(default_recipe("finetune"), overrides)
    model = run.accelerator.unwrap_model(run.method.student.transformer)
    optimizer = run.method.optimizer.optimizer
    losses, grads, graphs = [], [], []
    step = optimizer.step

    def recording_step(*args, **kwargs):
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    optimizer.step = recording_step

    class Record(TrainerCallback):
        def on_step_end(self, trainer, step, logs):
            losses.append(float(logs["loss"]))
            graphs.append(counters["stats"]["unique_graphs"])

    run.callbacks.append(Record())
    Trainer(run).run()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return losses, grads, graphs


@pytest.mark.slow  # ~35 s of CPU: Dynamo and AOTAutograd trace the block's forward and backward
def test_compiled_blocks_match_eager_and_compile_once(tmp_path, aot_eager_blocks):
    eager_losses, eager_grads, eager_graphs = run_three_steps(tmp_path, "none")
    assert eager_graphs == [0, 0, 0]
    losses, grads, graphs = run_three_steps(tmp_path, "blocks")
    # Both WanTransformerBlocks share one graph, built in step 1; steps 2 and 3 reuse it.
    assert graphs == [1, 1, 1]
    assert not aot_eager_blocks["recompiles"]
    assert len(losses) == len(eager_losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-5)
    assert len(grads) == 3 and all(set(g) == set(e) and g for g, e in zip(grads, eager_grads))
    for g, e in zip(grads, eager_grads):
        for name in e:
            torch.testing.assert_close(g[name], e[name], rtol=1e-5, atol=1e-6, msg=name)


def test_compile_refuses_a_transformer_without_repeated_blocks():
    from diffusers import CosmosTransformer3DModel

    from fv_accel.models.student import DiffusersStudent

    cosmos = CosmosTransformer3DModel(
        num_attention_heads=2, attention_head_dim=12, num_layers=1, text_embed_dim=16, adaln_lora_dim=4,
        max_size=(4, 8, 8), encoder_hidden_states_channels=16, crossattn_proj_in_channels=16,
    )
    assert not getattr(cosmos, "_repeated_blocks", None)
    student = DiffusersStudent.__new__(DiffusersStudent)
    student.modules, student.family = [cosmos], "cosmos2"
    with pytest.raises(ValueError, match=r"^training.model.compile: blocks: the cosmos2 family's CosmosTransformer3DModel"):
        student.compile_blocks()
