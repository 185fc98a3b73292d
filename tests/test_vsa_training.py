"""Video sparse attention in training (`training.vsa`): the recipe and its ramp, the methods'
"vsa" attention kind, the gates trained (full and LoRA), loaded from FastWan checkpoints, kept by
exports, the refusals, exact resume and 2 processes == 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fv_accel import vsa
from fv_accel.config import ConfigError, VSAConfig, default_recipe, load_config, parse_cli
from fv_accel.trainer import Trainer
from fv_accel.vsa import enable_vsa, ramp_sparsity
from tests.conftest import tiny_overrides
from tests.test_resume import SignalAtStep

REPO = Path(__file__).resolve().parent.parent
ACCELERATE = Path(sys.executable).parent / "accelerate"
VSA = {"training.vsa.sparsity": 0.75}


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


def gate_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if vsa.is_gate_key(k)}


def build(recipe: str, overrides: dict, callbacks=None):
    from fv_accel.build import build_from_config
    from tests.resume_helpers import reset_accelerate

    reset_accelerate()
    return build_from_config(recipe, overrides, callbacks=callbacks)


# --------------------------------------------------------------------------------------------
# The recipe and the ramp
# --------------------------------------------------------------------------------------------


def test_the_ramp_is_a_function_of_the_step():
    assert [ramp_sparsity(s, 0.75) for s in (0, 1, 100)] == [0.75, 0.75, 0.75]
    # decay 0.25 every 2 steps up to 0.6: steps 0-1 dense, then 0.25, 0.5, capped at 0.6.
    assert [ramp_sparsity(s, 0.6, 0.25, 2) for s in range(8)] == [0.0, 0.0, 0.25, 0.25, 0.5, 0.5, 0.6, 0.6]
    assert ramp_sparsity(10**6, 0.9, 0.1, 1) == 0.9
    assert ramp_sparsity(3, 0.9, 0.1, 1) == pytest.approx(0.3)


def test_recipe_keys_parse_and_bad_values_fail_in_one_line():
    cfg, _ = parse_cli(["--config", "configs/tiny_finetune.yaml", "--training.vsa.sparsity", "0.75"], "finetune")
    assert cfg.training.vsa == VSAConfig(sparsity=0.75) and cfg.training.vsa.enabled
    assert not load_config(default_recipe("finetune")).training.vsa.enabled
    import typing

    assert typing.get_args(typing.get_type_hints(VSAConfig)["backend"]) == vsa.BACKENDS
    bad = [
        ({"training.vsa.sparsity": "1.0"}, "key 'training.vsa.sparsity': expected a number in [0, 1), got 1.0"),
        ({"training.vsa.sparsity": "-0.1"}, "key 'training.vsa.sparsity': expected a number in [0, 1), got -0.1"),
        ({"training.vsa.backend": "triton"}, "key 'training.vsa.backend'"),
        ({"training.vsa.sparsity": "0.5", "training.vsa.decay_rate": "0.1"}, "key 'training.vsa.decay_interval_steps'"),
        ({"training.vsa.decay_rate": "0.1", "training.vsa.decay_interval_steps": "5"}, "key 'training.vsa.decay_rate'"),
        ({"training.vsa.sparsity": "0.5", "models.student.storage_dtype": "bfloat16", "models.student.lora.enable": "true"},
         "key 'training.vsa.sparsity': 0.5 with models.student.storage_dtype"),
        ({"training.vsa.sparsity": "0.5", "training.model.context_parallel.ulysses": "2"},
         "key 'training.vsa.sparsity': 0.5: video sparse attention does not run under training.model.context_parallel"),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError) as err:
            load_config(default_recipe("finetune"), overrides)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_causal_student_refuses_vsa_in_one_line():
    for recipe, method in (("configs/tiny_dfsft_causal.yaml", "dfsft"),):
        with pytest.raises(ConfigError) as err:
            parse_cli(["--config", recipe, "--training.vsa.sparsity", "0.75"], method)
        text = str(err.value)
        assert "key 'training.vsa.sparsity': 0.75: video sparse attention does not combine with a block-causal student" in text
        assert "\n" not in text
    with pytest.raises(ConfigError, match="training.vsa.sparsity"):
        load_config(default_recipe("dfsft"), {"method.name": "tfsft", "models.student.causal": True, **VSA})


def test_a_family_vsa_does_not_serve_refuses_in_one_line(tiny_model_of, tmp_path):
    from fv_accel.models import build_student

    cfg = load_config(default_recipe("finetune"), {"models.student.init_from": str(tiny_model_of("ltx_video")), **VSA})
    with pytest.raises(ConfigError) as err:
        build_student(cfg)
    text = str(err.value)
    assert text.startswith("training.vsa.sparsity 0.75: the ltx_video family cannot train with it")
    assert "LTXVideoTransformer3DModel" in text and "\n" not in text


# --------------------------------------------------------------------------------------------
# Training runs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["finetune", "dfsft"])
def test_a_short_vsa_run_trains_the_gates_and_the_saved_transformer_loads_strictly(method, tmp_path, monkeypatch):
    from diffusers import WanTransformer3DModel

    seen = []
    real = vsa.video_sparse_attention

    def recording(q, k, v, *, grid, sparsity, gate=None, backend="auto"):
        seen.append((grid, sparsity))
        return real(q, k, v, grid=grid, sparsity=sparsity, gate=gate, backend=backend)

    monkeypatch.setattr(vsa, "video_sparse_attention", recording)
    run = build(default_recipe(method), tiny_overrides(tmp_path, **VSA, **{"training.loop.max_train_steps": 3}))
    assert run.method._attn_kind == "vsa"
    batches = []
    real_step = run.method.single_train_step

    def step(batch, iteration):
        out = real_step(batch, iteration)
        batches.append(out[1]["training_batch"].attn_metadata_vsa)
        assert out[1]["_fv_backward"][1] is batches[-1]  # the backward carries the VSA metadata
        return out

    run.method.single_train_step = step
    Trainer(run).run()
    # 21 frames of 48 x 48 -> latents 6 x 6 x 6 -> a 6 x 3 x 3 token grid (patch 1 x 2 x 2): 2 tiles.
    assert batches == [vsa.VSAMetadata((6, 3, 3), (2, 1, 1), 0.75)] * 3
    assert seen and all(call == ((6, 3, 3), 0.75) for call in seen)
    assert [m["vsa_sparsity"] for m in metrics(tmp_path / "out") if "loss" in m] == [0.75] * 3
    folder = tmp_path / "out" / "transformer"
    gates = gate_tensors(folder / "diffusion_pytorch_model.safetensors")
    assert sorted(gates) == [f"blocks.{i}.attn1.to_gate_compress.{p}" for i in range(2) for p in ("bias", "weight")]
    assert all(t.abs().max() > 0 for k, t in gates.items() if k.endswith("weight"))  # trained from zero
    stock = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder))
    enable_vsa(stock, sparsity=0.75)
    stock.load_state_dict(load_file(str(folder / "diffusion_pytorch_model.safetensors")), strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("entry,recipe", [("train_finetune.py", "configs/tiny_finetune.yaml"), ("train_dfsft.py", "configs/tiny_dfsft.yaml")])
def test_the_entry_scripts_train_with_the_sparsity_override(entry, recipe, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [str(ACCELERATE), "launch", "--num_processes", "1", "--main_process_port", "0", entry, "--config", recipe,
           "--training.vsa.sparsity", "0.75", "--max_train_steps", "2", "--output_dir", str(out),
           "--callbacks.validation.enable", "false", "--training.tracker.trackers", "[none]",
           "--training.tracker.write_plots", "false"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "VSA on WanTransformer3DModel (Wan): sparsity 0.75" in proc.stderr
    gates = gate_tensors(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert len(gates) == 2 * (4 if "dfsft" in entry else 2)
    assert all(t.abs().max() > 0 for k, t in gates.items() if k.endswith("weight"))
    assert [m["vsa_sparsity"] for m in metrics(out) if "loss" in m] == [0.75, 0.75]


@pytest.mark.slow
def test_the_heldout_loss_reports_the_sparse_and_the_dense_view(tmp_path):
    over = tiny_overrides(tmp_path, **VSA, **{
        "training.loop.max_train_steps": 1,
        "callbacks.validation.enable": True,
        "callbacks.validation.prompts": [],
        "callbacks.validation.at_start": True,
        "callbacks.validation.heldout_data_path": "tiny",
        "callbacks.validation.heldout_max_samples": 1,
    })
    run = build(default_recipe("finetune"), over)
    controller = run.method.student.vsa_controllers[0]
    Trainer(run).run()
    heldout = [m for m in metrics(tmp_path / "out") if "heldout/loss" in m]
    assert [m["step"] for m in heldout] == [0, 1]
    for m in heldout:
        assert {"heldout/dense_loss", "heldout/dense_sigma_0.50"} <= set(m)
        # 2 tiles, 1 kept at 0.75: the dense view (every tile) differs from the sparse one.
        assert abs(m["heldout/loss"] - m["heldout/dense_loss"]) > 1e-6
    assert controller.sparsity == 0.75  # the dense view ends with the evaluation


def test_the_model_card_says_to_enable_vsa(tmp_path):
    run = build(default_recipe("finetune"), tiny_overrides(tmp_path, **VSA, **{"training.loop.max_train_steps": 1}))
    Trainer(run).run()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "video sparse attention (VSA, fv_accel.vsa): sparsity 0.75" in card
    assert "fv_accel.vsa.enable_vsa(pipe.transformer, sparsity=0.75)` before sampling" in card
    assert f'load_vsa_gates(transformer, "{(tmp_path / "out").resolve()}/transformer")' in card


# --------------------------------------------------------------------------------------------
# Gates from checkpoints, LoRA, exports
# --------------------------------------------------------------------------------------------


def _fastwan_folder(tiny_model_dir, tmp_path: Path) -> tuple[Path, dict]:
    """The tiny Wan model with FastWan's gate keys (`blocks.N.to_gate_compress.*`) added to its transformer."""
    import shutil

    folder = tmp_path / "fastwan"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    config = json.loads((folder / "transformer" / "config.json").read_text())
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    g = torch.Generator().manual_seed(5)
    gates = {f"blocks.{i}.to_gate_compress.{p}": torch.randn(*((dim, dim) if p == "weight" else (dim,)), generator=g)
             for i in range(config["num_layers"]) for p in ("weight", "bias")}
    save_file({**state, **gates}, str(weights))
    return folder, gates


def test_init_from_a_fastwan_folder_keeps_its_gates_and_a_stock_one_starts_at_zero(tiny_model_dir, tmp_path):
    from fv_accel.models import build_student

    folder, gates = _fastwan_folder(tiny_model_dir, tmp_path)
    student = build_student(load_config(default_recipe("finetune"), {"models.student.init_from": str(folder), **VSA}))
    state = student.transformer.state_dict()
    for key, value in gates.items():
        assert torch.equal(state[vsa.fastwan_key_to_ours(key)], value), key
    stock = build_student(load_config(default_recipe("finetune"), {"models.student.init_from": str(tiny_model_dir), **VSA}))
    stock_gates = {k: v for k, v in stock.transformer.state_dict().items() if vsa.is_gate_key(k)}
    assert len(stock_gates) == len(gates) and all(v.abs().max() == 0 for v in stock_gates.values())


def test_lora_trains_the_gates_beside_the_adapter_and_writes_them_in_its_file(tiny_model_dir, tmp_path):
    from diffusers import WanPipeline

    from fv_accel.export import export

    over = tiny_overrides(tmp_path, **VSA, **{
        "models.student.init_from": str(tiny_model_dir),
        "models.student.lora.enable": True,
        "models.student.lora.rank": 2,
        "models.student.lora.alpha": 4.0,
        "training.loop.max_train_steps": 3,
        "training.optimizer.lr_warmup_steps": 0,
    })
    run = build(default_recipe("finetune"), over)
    student = run.method.student
    trainable = {n for n, p in student.transformer.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or vsa.is_gate_key(n) for n in trainable)
    assert {n for n in trainable if vsa.is_gate_key(n)} == {f"blocks.{i}.attn1.to_gate_compress.{p}" for i in range(2) for p in ("weight", "bias")}
    Trainer(run).run()
    out = tmp_path / "out"
    gates = gate_tensors(out / "pytorch_lora_weights.safetensors")
    assert sorted(gates) == sorted(f"transformer.blocks.{i}.attn1.to_gate_compress.{p}" for i in range(2) for p in ("weight", "bias"))
    assert all(t.abs().max() > 0 for t in gates.values())
    assert not gate_tensors(out / "pytorch_lora_weights_comfyui.safetensors")  # ComfyUI has no VSA
    # Into a stock pipeline: the trained transformer's weights, gates included, and the adapter's alpha.
    trained = {k.replace(".default.", "."): v for k, v in student.transformer.state_dict().items()}
    pipe = WanPipeline.from_pretrained(tiny_model_dir)
    controller = vsa.load_vsa_lora(pipe, out, sparsity=0.75)
    assert controller.sparsity == 0.75
    loaded = {k.replace(".default_0.", "."): v for k, v in pipe.transformer.state_dict().items()}
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k], trained[k].to(loaded[k].dtype)) for k in trained)
    assert pipe.transformer.peft_config["default_0"].lora_alpha == 4
    with pytest.raises(ValueError, match="Make sure all LoRA param names contain"):
        WanPipeline.from_pretrained(tiny_model_dir).load_lora_weights(out)  # why load_vsa_lora exists
    # The merged export folds the adapter in and keeps the gates: strict into a stock transformer + enable_vsa.
    (merged,) = export(out, "merged", tmp_path / "merged")
    from diffusers import WanTransformer3DModel

    saved = load_file(str(merged / "diffusion_pytorch_model.safetensors"))
    for key, value in gates.items():
        assert torch.equal(saved[key[len("transformer."):]], value.to(saved[key[len("transformer."):]].dtype))
    stock = WanTransformer3DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    enable_vsa(stock, 0.75)
    stock.load_state_dict(saved, strict=True)


def test_a_full_runs_checkpoint_exports_with_its_gates(tmp_path):
    from fv_accel.export import export

    over = tiny_overrides(tmp_path, **VSA, **{"training.loop.max_train_steps": 2,
                                               "training.checkpoint.training_state_checkpointing_steps": 2})
    Trainer(build(default_recipe("finetune"), over)).run()
    (folder,) = export(tmp_path / "out" / "checkpoint-2", "diffusers", tmp_path / "exported")
    exported = gate_tensors(folder / "diffusion_pytorch_model.safetensors")
    final = gate_tensors(tmp_path / "out" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == final.keys() and len(final) == 4
    assert all(torch.equal(exported[k], final[k]) for k in final)


# --------------------------------------------------------------------------------------------
# Exact resume of the ramp
# --------------------------------------------------------------------------------------------


def _history(trainer) -> list[tuple]:
    return [(h["step"], h["loss"], h["vsa_sparsity"], h["grad_norm"]) for h in trainer.history]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"models.student.lora.enable": True, "models.student.lora.rank": 4}], ids=["full", "lora"])
def test_a_resumed_run_continues_the_ramp_exactly(tmp_path, extra):
    from tests.resume_helpers import small_overrides, weights, write_latent_dataset

    # Latents 5 x 10 x 10: a 5 x 5 x 5 token grid, 8 tiles, so the sparsity changes which are kept.
    data = write_latent_dataset(tmp_path / "data", num_clips=6, frames=5, height=10, width=10)
    ramp = {"training.vsa.sparsity": 0.75, "training.vsa.decay_rate": 0.25, "training.vsa.decay_interval_steps": 2,
            "training.loop.max_train_steps": 6, **extra}

    def over(name: str, **more) -> dict:
        return small_overrides(tmp_path / name, data, **ramp, **more)

    full_run = build(default_recipe("finetune"), over("full"))
    full = Trainer(full_run)
    full.run()
    first_run = build(default_recipe("finetune"), over("cut"))
    first = Trainer(first_run, callbacks=[*first_run.callbacks, SignalAtStep(3)])
    assert first.run()["final_step"] == 3
    resumed_run = build(default_recipe("finetune"), over("cut", **{"training.checkpoint.resume_from_checkpoint": "latest"}))
    assert resumed_run.start_step == 3
    resumed = Trainer(resumed_run)
    assert resumed_run.method.student.vsa_controllers[0].sparsity == 0.25  # the ramp at the checkpoint's step
    resumed.run()
    assert [h[2] for h in _history(full)] == [0.0, 0.25, 0.25, 0.5, 0.5, 0.75]
    assert _history(first) + _history(resumed) == _history(full)
    full_w, resumed_w = weights(full_run), weights(resumed_run)
    assert any(vsa.is_gate_key(k) for k in full_w)
    assert all(torch.equal(full_w[k], resumed_w[k]) for k in full_w)


def test_resuming_with_another_ramp_is_refused(tmp_path):
    from tests.resume_helpers import small_overrides, write_latent_dataset

    data = write_latent_dataset(tmp_path / "data", num_clips=4, frames=5, height=10, width=10)
    over = small_overrides(tmp_path / "run", data, **VSA, **{"training.loop.max_train_steps": 2,
                                                             "training.checkpoint.training_state_checkpointing_steps": 2})
    Trainer(build(default_recipe("finetune"), over)).run()
    changed = {**over, "training.vsa.sparsity": 0.5, "training.loop.max_train_steps": 3,
               "training.checkpoint.resume_from_checkpoint": "latest"}
    with pytest.raises(Exception, match="method.vsa") as err:
        build(default_recipe("finetune"), changed)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# 2 processes == 1
# --------------------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_two_processes_equal_one_process_with_vsa(tiny_data_path, tmp_path):
    from tests.test_distributed import RECIPES, WEIGHT_TOL, _single_process, launch, max_diff, overrides

    runs = [{"name": "finetune_vsa_2proc", "recipe": RECIPES["finetune"], "engine": "launch",
             "overrides": overrides(tmp_path / "finetune_vsa_2proc", **VSA, **{"training.data.train_batch_size": 1})}]
    records = launch("accelerate_configs/cpu_2proc.yaml", runs, tmp_path)["finetune_vsa_2proc"]
    folder = tmp_path / "records" / "finetune_vsa_2proc"
    w0, w1 = (load_file(str(folder / f"rank{r}.safetensors")) for r in (0, 1))
    assert max_diff(w0, w1) == 0.0
    assert any(vsa.is_gate_key(k) for k in w0)
    init = load_file(str(folder / "init.safetensors"))
    assert max(w0[k].abs().max().item() for k in w0 if vsa.is_gate_key(k)) > 0 == max(
        init[k].abs().max().item() for k in init if vsa.is_gate_key(k))
    one, w_one = _single_process("finetune_vsa_batch2", "finetune", tmp_path, **VSA, **{"training.data.train_batch_size": 2})
    assert max_diff(w0, w_one) < WEIGHT_TOL
    for step in range(len(one["logged"])):
        mean = (records[0]["steps"][step]["local_loss"] + records[1]["steps"][step]["local_loss"]) / 2
        assert one["logged"][step]["loss"] == pytest.approx(mean, abs=1e-5)
    for record in (records[0], one):
        assert [m["vsa_sparsity"] for m in metrics(Path(record["output_dir"])) if "loss" in m] == [0.75] * len(one["logged"])


@pytest.mark.multiproc
def test_fsdp2_saves_the_trained_gates_full_and_lora(tiny_data_path, tmp_path):
    """Under FSDP2 the final transformer is rebuilt from the gathered state dict (with VSA enabled,
    so the gates load) and the LoRA file gathers the gates too; the full run's weights equal one process's."""
    from tests.test_distributed import LORA, RECIPES, WEIGHT_TOL, _single_process, launch, overrides

    runs = [
        {"name": "full_vsa_fsdp2", "recipe": RECIPES["finetune"], "engine": "fsdp2",
         "overrides": overrides(tmp_path / "full_vsa_fsdp2", **VSA, **{"training.data.train_batch_size": 1})},
        {"name": "lora_vsa_fsdp2", "recipe": RECIPES["finetune"], "engine": "fsdp2",
         "overrides": overrides(tmp_path / "lora_vsa_fsdp2", **VSA, **LORA)},
    ]
    launch("accelerate_configs/fsdp2.yaml", runs, tmp_path, "--mixed_precision", "no")
    full = load_file(str(tmp_path / "full_vsa_fsdp2" / "transformer" / "diffusion_pytorch_model.safetensors"))
    _, one = _single_process("full_vsa_batch2", "finetune", tmp_path, **VSA, **{"training.data.train_batch_size": 2})
    assert sorted(full) == sorted(one) and sum(vsa.is_gate_key(k) for k in full) == 4
    assert max((full[k].float() - one[k]).abs().max().item() for k in one) < WEIGHT_TOL
    lora_gates = gate_tensors(tmp_path / "lora_vsa_fsdp2" / "pytorch_lora_weights.safetensors")
    assert len(lora_gates) == 4 and all(t.abs().max() > 0 for t in lora_gates.values())


def test_lora_on_a_bfloat16_base_trains_fp32_gates(tmp_path):
    over = tiny_overrides(tmp_path, **VSA, **{"models.student.torch_dtype": "bfloat16", "models.student.lora.enable": True,
                                               "training.loop.max_train_steps": 1, "training.optimizer.lr_warmup_steps": 0})
    run = build(default_recipe("finetune"), over)
    gates = [p for n, p in run.method.student.transformer.named_parameters() if vsa.is_gate_key(n)]
    assert len(gates) == 4 and all(p.dtype == torch.float32 and p.requires_grad for p in gates)
    summary = Trainer(run).run()
    assert torch.isfinite(torch.tensor(summary["last_loss"]))
    assert all(p.abs().max() > 0 for p in gates)
