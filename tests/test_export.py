"""`python -m fv_accel.export`: from a run's output folder or checkpoint to files that stock
diffusers loads (LoRA with metadata, ComfyUI layout, merged transformer, full transformer)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fv_accel.build import build_from_config
from fv_accel.config import default_recipe
from fv_accel.export import main as export_main
from fv_accel.models.lora import BASE_MODEL_FILE, COMFYUI_LORA_FILE, DIFFUSERS_LORA_FILE
from fv_accel.trainer import Trainer, TrainerCallback
from tests.conftest import tiny_overrides
from tests.test_lora import fixed_input, lora_overrides, student_prediction, transformer_prediction


def _reset():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


class _WeightsAtStep(TrainerCallback):
    """The unwrapped transformer's state dict after a given step (what that checkpoint holds)."""

    def __init__(self, step: int):
        self.step, self.state = step, None

    def on_step_end(self, trainer, step, logs):
        if step == self.step:
            model = trainer.accelerator.unwrap_model(trainer.method.student.transformer)
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(tmp, overrides, callbacks=()):
    run = build_from_config(default_recipe("finetune"), overrides, callbacks=list(callbacks))
    Trainer(run).run()
    _reset()
    return run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir, tiny_data_path):
    tmp = tmp_path_factory.mktemp("export_lora")
    run = _train(
        tmp,
        lora_overrides(tmp, tiny_model_dir, tiny_data_path, **{"training.checkpoint.training_state_checkpointing_steps": 1}),
    )
    return run, tmp / "out"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_model_dir, tiny_data_path):
    tmp = tmp_path_factory.mktemp("export_full")
    at_step_1 = _WeightsAtStep(1)
    overrides = tiny_overrides(
        tmp,
        **{
            "models.student.init_from": str(tiny_model_dir),
            "models.student.transformer_config": None,
            "training.data.data_path": tiny_data_path,
            "training.loop.max_train_steps": 2,
            "training.optimizer.lr_warmup_steps": 0,
            "training.checkpoint.training_state_checkpointing_steps": 1,
        },
    )
    run = _train(tmp, overrides, [at_step_1])
    return run, tmp / "out", at_step_1.state


def test_lora_exports_from_the_output_folder(lora_run, tiny_model_dir, tmp_path, capsys):
    from diffusers import WanPipeline, WanTransformer3DModel

    run, out = lora_run
    for target in ("diffusers", "comfyui", "merged"):
        export_main([str(out), "--to", target, "--out", str(tmp_path / target)])
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "diffusers" / DIFFUSERS_LORA_FILE).read_bytes() == (out / DIFFUSERS_LORA_FILE).read_bytes()
    comfy, original = load_file(str(tmp_path / "comfyui" / COMFYUI_LORA_FILE)), load_file(str(out / COMFYUI_LORA_FILE))
    assert comfy.keys() == original.keys() and all(torch.equal(comfy[k], original[k]) for k in comfy)

    # Merged == base + LoRA (diffusers' own loader) == the trained student, to 1e-5.
    x, t, text = fixed_input()
    merged = WanTransformer3DModel.from_pretrained(tmp_path / "merged", subfolder="transformer")
    base = WanTransformer3DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    assert merged.state_dict().keys() == base.state_dict().keys()
    assert not torch.equal(merged.blocks[0].attn1.to_q.weight, base.blocks[0].attn1.to_q.weight)
    assert torch.equal(merged.blocks[0].ffn.net[2].weight, base.blocks[0].ffn.net[2].weight)  # not adapted
    pipe = WanPipeline.from_pretrained(tiny_model_dir)
    pipe.load_lora_weights(out)
    with_lora = transformer_prediction(pipe.transformer, x, t, text)
    got = transformer_prediction(merged, x, t, text)
    assert (got - with_lora).abs().max() < 1e-5
    assert (got - student_prediction(run.method.student, x, t, text)).abs().max() < 1e-5
    assert sorted(p.name for p in (tmp_path / "merged" / "transformer").iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
    ]


def test_lora_exports_from_a_checkpoint(lora_run, tiny_model_dir, tmp_path):
    from diffusers import WanPipeline, WanTransformer3DModel

    _, out = lora_run
    ckpt = out / "checkpoint-1"
    assert not (ckpt / "model.safetensors").exists()
    export_main([str(ckpt), "--to", "merged", "--out", str(tmp_path / "merged")])  # base from metadata.json
    export_main([str(ckpt), "--to", "comfyui", "--out", str(tmp_path / "comfy")])
    x, t, text = fixed_input()
    pipe = WanPipeline.from_pretrained(tiny_model_dir)
    pipe.load_lora_weights(ckpt)  # a LoRA checkpoint is itself a diffusers LoRA folder
    expected = transformer_prediction(pipe.transformer, x, t, text)
    merged = WanTransformer3DModel.from_pretrained(tmp_path / "merged", subfolder="transformer")
    assert (transformer_prediction(merged, x, t, text) - expected).abs().max() < 1e-5
    pipe.unload_lora_weights()
    pipe.load_lora_weights(tmp_path / "comfy", weight_name=COMFYUI_LORA_FILE)
    assert (transformer_prediction(pipe.transformer, x, t, text) - expected).abs().max() < 1e-5
    # The step-1 adapter is not the final one: the checkpoint was really read.
    pipe.unload_lora_weights()
    pipe.load_lora_weights(out)
    assert (transformer_prediction(pipe.transformer, x, t, text) - expected).abs().max() > 1e-4


def test_merged_export_of_a_random_init_base_needs_base(lora_run, tiny_model_dir, tmp_path):
    _, out = lora_run
    src = tmp_path / "inline_run"
    src.mkdir()
    shutil.copyfile(out / DIFFUSERS_LORA_FILE, src / DIFFUSERS_LORA_FILE)
    info = json.loads((out / BASE_MODEL_FILE).read_text())
    (src / BASE_MODEL_FILE).write_text(json.dumps({**info, "init_from": None, "transformer_config": {"num_layers": 2}}))
    with pytest.raises(SystemExit, match="random init.*--base"):
        export_main([str(src), "--to", "merged", "--out", str(tmp_path / "m")])
    export_main([str(src), "--to", "merged", "--out", str(tmp_path / "m"), "--base", str(tiny_model_dir)])
    assert (tmp_path / "m" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


def test_full_run_saves_a_transformer_folder_that_reloads(full_run):
    from diffusers import WanTransformer3DModel

    run, out, _ = full_run
    assert not (out / DIFFUSERS_LORA_FILE).exists()
    files = sorted(p.name for p in (out / "transformer").iterdir())
    assert files == ["config.json", "diffusion_pytorch_model.safetensors"]
    reloaded = WanTransformer3DModel.from_pretrained(out, subfolder="transformer")
    trained = run.accelerator.unwrap_model(run.method.student.transformer)
    state = trained.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in reloaded.state_dict().items())
    x, t, text = fixed_input()
    assert (transformer_prediction(reloaded, x, t, text) - student_prediction(run.method.student, x, t, text)).abs().max() < 1e-5


def test_full_checkpoint_exports_to_a_transformer_folder(full_run, tmp_path, capsys, monkeypatch):
    from diffusers import WanTransformer3DModel

    _, out, at_step_1 = full_run
    export_main([str(out / "checkpoint-1"), "--to", "diffusers", "--out", str(tmp_path / "ck1")])
    # The export's stages as a progress bar on stderr (reading, loading, saving), on rank 0 only.
    assert re.search(r"export --to diffusers: 100%.*\| 3/3 .*done", capsys.readouterr().err)
    monkeypatch.setenv("RANK", "1")
    export_main([str(out / "checkpoint-1"), "--to", "diffusers", "--out", str(tmp_path / "ck1-rank1")])
    assert "export --to" not in capsys.readouterr().err
    monkeypatch.delenv("RANK")
    exported = WanTransformer3DModel.from_pretrained(tmp_path / "ck1", subfolder="transformer").state_dict()
    assert exported.keys() == at_step_1.keys()
    assert all(torch.equal(exported[k], at_step_1[k]) for k in exported)
    # From the output folder the final transformer is taken; a full run has no LoRA to convert.
    export_main([str(out), "--to", "diffusers", "--out", str(tmp_path / "final")])
    assert (tmp_path / "final" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    with pytest.raises(SystemExit, match="ComfyUI export is for LoRA runs"):
        export_main([str(out), "--to", "comfyui", "--out", str(tmp_path / "c")])
    with pytest.raises(SystemExit, match="already a whole transformer"):
        export_main([str(out), "--to", "merged", "--out", str(tmp_path / "c")])


def test_export_of_nothing_says_what_it_looked_for(tmp_path):
    with pytest.raises(SystemExit, match="found no weights to export.*pytorch_lora_weights.safetensors"):
        export_main([str(tmp_path), "--to", "diffusers"])
