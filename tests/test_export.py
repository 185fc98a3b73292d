"""`python -m fv_accel.export`: from a run's output folder or checkpoint to files that stock
diffusers loads (LoRA with metadata, ComfyUI layout, merged transformer, full transformer)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

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
    # The export's stages on stderr (reading, loading, saving), on rank 0 only; stderr is no terminal
    # here: plain lines, the last one saying done.
    err = capsys.readouterr().err
    assert re.search(r"export --to diffusers: 3/3 stage \(100%\), .*, done\n$", err) and "\r" not in err, err
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


# ---- issue 28: an export killed at any point leaves no folder that looks complete -----------------

def test_an_export_killed_at_any_stage_leaves_no_folder_that_looks_complete(lora_run, full_run, tmp_path):
    """Each target, from each kind of source, killed with SIGKILL on entering each of its stages, in
    the middle of writing its weights (config.json written, weights not: the reported case) and just
    before its rename: its folder does not exist, only `<out>.partial`. The next export to the same
    folder names that partial export, removes it and writes the complete export; one killed just after
    the rename is complete (byte for byte the same)."""
    from fv_accel.export import partial_export_dir
    from tests.export_kill import run_case

    _, lora_out = lora_run
    _, full_out, _ = full_run
    sources = [  # (name, export arguments, stages)
        ("lora_diffusers", [str(lora_out), "--to", "diffusers"], 1),
        ("lora_comfyui", [str(lora_out), "--to", "comfyui"], 1),
        ("lora_merged", [str(lora_out), "--to", "merged"], 4),
        ("checkpoint_diffusers", [str(full_out / "checkpoint-1"), "--to", "diffusers"], 3),
        ("transformer_diffusers", [str(full_out), "--to", "diffusers"], 1),
    ]
    cases, expect = [], []
    for name, args, stages in sources:
        out = tmp_path / name
        watch = [str(out), str(partial_export_dir(out))]
        for point in [*(f"stage:{k}" for k in range(1, stages + 1)), "write", "publish:before", None, "publish:after"]:
            target = tmp_path / f"{name}_after" if point == "publish:after" else out
            cases.append({"args": [*args, "--out", str(target)], "kill": point, "watch": [str(target), *watch]})
            expect.append((name, target, point))
    results = [run_case(case) for case in cases]

    complete: dict[str, dict] = {}
    left: dict[str, list] = {}
    for (name, out, point), result in zip(expect, results):
        partial = str(partial_export_dir(out))
        seen = result["listings"]
        if point is None:  # the next export, after the killed ones
            assert result["status"] == 0, result["stderr"][-3000:]
            assert f"removing {partial}: the partial export an interrupted export left" in result["stderr"]
            assert seen[partial] is None
            complete[name] = seen[str(out)]
            assert complete[name] and not any(".fv_export" in f for f in complete[name])
            continue
        assert result["status"] == "killed", (name, point, result["stderr"][-3000:])
        if point == "publish:after":
            assert seen[str(out)] == complete[name], (name, point)
            continue
        # Killed before the rename: nothing at the export's folder; the partial one holds what was written.
        assert seen[str(out)] is None, (name, point, seen[str(out)])
        assert seen[partial] is not None, (name, point)
        left.setdefault(name, []).append(sorted(f for f in seen[partial] if not f.startswith(".")))
    # The "write" kills were inside the writing: a transformer folder with its config.json and no weights
    # (the reported case), a LoRA file cut short.
    for name in ("lora_merged", "checkpoint_diffusers"):
        assert ["transformer/config.json"] in left[name], left[name]
    assert [DIFFUSERS_LORA_FILE] in left["lora_diffusers"] and [COMFYUI_LORA_FILE] in left["lora_comfyui"]


def _lying_header(src: Path, dst: Path) -> None:
    """A copy of a safetensors file whose header claims more bytes for its first tensor than the file holds."""
    import struct

    data = src.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + 4096]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    dst.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_a_lora_file_with_a_lying_header_fails_in_one_line_naming_it(lora_run, tiny_model_dir, tmp_path):
    _, out = lora_run
    bad = tmp_path / "bad_lora.safetensors"
    _lying_header(out / DIFFUSERS_LORA_FILE, bad)
    for target in ("comfyui", "merged"):
        with pytest.raises(SystemExit) as err:
            export_main([str(bad), "--to", target, "--out", str(tmp_path / target), "--base", str(tiny_model_dir)])
        assert str(err.value) == (
            f"export failed: {bad}: not a readable safetensors file (SafetensorError: Error while deserializing header: "
            "invalid shape, data type, or offset for tensor)"
        )
        assert not (tmp_path / target).exists() and not (tmp_path / f"{target}.partial").exists()


def test_an_export_to_a_folder_it_cannot_write_fails_in_one_line_naming_it(lora_run, tmp_path, monkeypatch):
    """A read-only folder (as root, permission bits do not stop a write: the refusal is the OS's, emulated)."""
    _, out = lora_run
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if Path(path).parent == readonly:
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(SystemExit) as err:
        export_main([str(out), "--to", "comfyui", "--out", str(readonly / "comfy")])
    assert str(err.value) == f"export failed: cannot write the export {readonly / 'comfy'}: {readonly / 'comfy.partial'}: Permission denied"
