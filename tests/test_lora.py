"""LoRA through peft: only the adapter trains (fp32, any base dtype), with both methods, gradient
checkpointing and accumulation; the files it writes load into a stock diffusers WanPipeline."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from fv_accel.build import build_from_config
from fv_accel.config import default_recipe
from fv_accel.models.base import TrainingBatch
from fv_accel.models.lora import BASE_MODEL_FILE, COMFYUI_LORA_FILE, DIFFUSERS_LORA_FILE, read_lora_file
from fv_accel.trainer import Trainer
from tests.conftest import tiny_overrides

RANK, ALPHA = 4, 12.0  # alpha != rank: a loader that ignored the metadata would scale by 1, not 3


def lora_overrides(tmp_path, model_dir, data_path, **extra) -> dict:
    return tiny_overrides(
        tmp_path,
        **{
            "models.student.init_from": str(model_dir),
            "models.student.transformer_config": None,
            "models.student.lora.enable": True,
            "models.student.lora.rank": RANK,
            "models.student.lora.alpha": ALPHA,
            "training.data.data_path": data_path,
            # Large steps so that the adapter clearly moves the prediction in two steps.
            "training.optimizer.learning_rate": 1e-2,
            "training.optimizer.lr_warmup_steps": 0,
            "training.loop.max_train_steps": 2,
            **extra,
        },
    )


def unwrapped(run):
    return run.accelerator.unwrap_model(run.method.student.transformer)


def fixed_input(seed: int = 7):
    """A fixed latent/timestep/text input for the tiny model (16 channels, text dim 32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 3, 6, 6, generator=g)
    t = torch.tensor([640.0])
    text = torch.randn(1, 9, 32, generator=g)
    return x, t, text


@torch.no_grad()
def student_prediction(student, x, t, text):
    student.transformer.eval()
    return student.predict_noise(x, t, TrainingBatch(encoder_hidden_states=text)).float()


@torch.no_grad()
def transformer_prediction(transformer, x, t, text):
    transformer.eval()
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0].float()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir, tiny_data_path):
    """A finished 2-step LoRA SFT run on the tiny Hub-layout model: (run, base weights before)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    tmp = tmp_path_factory.mktemp("lora_run")
    run = build_from_config(default_recipe("finetune"), lora_overrides(tmp, tiny_model_dir, tiny_data_path))
    before = {n: p.detach().clone() for n, p in unwrapped(run).named_parameters()}
    Trainer(run).run()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return run, before, tmp / "out"


def test_lora_trains_only_the_adapter_in_fp32(lora_run):
    run, before, _ = lora_run
    model = unwrapped(run)
    after = dict(model.named_parameters())
    lora_names = [n for n in after if ".lora_" in n]
    base_names = [n for n in after if ".lora_" not in n]
    assert lora_names and base_names
    # The base is bit-identical after training; every adapter B (zero at init) has moved.
    for n in base_names:
        assert not after[n].requires_grad, n
        assert torch.equal(after[n], before[n]), n
    for n in lora_names:
        assert after[n].requires_grad and after[n].dtype == torch.float32, n
    moved_b = [n for n in lora_names if ".lora_B." in n and after[n].abs().max() > 0]
    assert len(moved_b) == len([n for n in lora_names if ".lora_B." in n])
    # Trainable count: r * (in + out) for each adapted Linear (q, k, v, out of both attentions).
    adapted = [m for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert len(adapted) == 2 * 8  # 2 blocks x (attn1 + attn2) x (to_q, to_k, to_v, to_out.0)
    expected = sum(RANK * (m.in_features + m.out_features) for m in adapted)
    assert sum(p.numel() for p in run.method.student.trainable_parameters()) == expected
    opt_params = [p for g in run.method.optimizer.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt_params) == expected


def test_lora_run_writes_only_lora_files(lora_run):
    _, _, out = lora_run
    assert (out / DIFFUSERS_LORA_FILE).is_file() and (out / COMFYUI_LORA_FILE).is_file()
    assert (out / BASE_MODEL_FILE).is_file()
    assert not (out / "transformer").exists()
    state, metadata = read_lora_file(out / DIFFUSERS_LORA_FILE)
    assert metadata["r"] == RANK and metadata["lora_alpha"] == ALPHA
    assert sorted(metadata["target_modules"]) == ["to_k", "to_out.0", "to_q", "to_v"]
    assert all(v.dtype == torch.float32 for v in state.values())


def test_diffusers_lora_reproduces_the_student_in_wan_pipeline(lora_run, tiny_model_dir):
    from diffusers import WanPipeline

    run, _, out = lora_run
    x, t, text = fixed_input()
    expected = student_prediction(run.method.student, x, t, text)
    pipe = WanPipeline.from_pretrained(tiny_model_dir)
    base = transformer_prediction(pipe.transformer, x, t, text)
    assert (base - expected).abs().max() > 1e-3  # the adapter matters at this input
    pipe.load_lora_weights(out)
    got = transformer_prediction(pipe.transformer, x, t, text)
    assert (got - expected).abs().max() < 1e-5
    # Without the metadata diffusers would assume alpha = rank: the test would see it.
    pipe.unload_lora_weights()
    state, _ = read_lora_file(out / DIFFUSERS_LORA_FILE)
    pipe.load_lora_weights({f"transformer.{k}": v for k, v in state.items()})
    wrong = transformer_prediction(pipe.transformer, x, t, text)
    assert (wrong - expected).abs().max() > 1e-4


def test_comfyui_file_has_the_same_tensors_and_diffusers_reads_it(lora_run, tiny_model_dir):
    from diffusers import WanPipeline

    run, _, out = lora_run
    state, _ = read_lora_file(out / DIFFUSERS_LORA_FILE)
    with safe_open(str(out / COMFYUI_LORA_FILE), framework="pt") as fh:
        comfy = {k: fh.get_tensor(k) for k in fh.keys()}
    assert all(k.startswith("diffusion_model.") for k in comfy)
    names = {"attn1": "self_attn", "attn2": "cross_attn"}
    short = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}
    expected_keys = set()
    for key, value in state.items():
        module, part = key.split(".lora_")
        block, idx, attn, proj = module.split(".", 3)
        wan = f"diffusion_model.{block}.{idx}.{names[attn]}.{short[proj]}"
        suffix = "lora_down.weight" if part.startswith("A.") else "lora_up.weight"
        assert torch.equal(comfy[f"{wan}.{suffix}"], value), key
        assert comfy[f"{wan}.alpha"].item() == ALPHA
        expected_keys |= {f"{wan}.{suffix}", f"{wan}.alpha"}
    assert set(comfy) == expected_keys
    x, t, text = fixed_input()
    pipe = WanPipeline.from_pretrained(tiny_model_dir)
    pipe.load_lora_weights(out, weight_name=COMFYUI_LORA_FILE)
    got = transformer_prediction(pipe.transformer, x, t, text)
    assert (got - student_prediction(run.method.student, x, t, text)).abs().max() < 1e-5


def _run_and_record_grads(tmp_path, model_dir, data_path, method, **extra):
    """One optimizer step; returns the adapter gradients the optimizer saw, by parameter name."""
    from accelerate.state import AcceleratorState, GradientState

    run = build_from_config(
        default_recipe(method),
        lora_overrides(tmp_path, model_dir, data_path, **{"training.loop.max_train_steps": 1, **extra}),
    )
    names = {id(p): n for n, p in unwrapped(run).named_parameters()}
    inner = run.method.optimizer.optimizer
    seen = {}
    original = inner.step

    def step(*args, **kwargs):
        for group in inner.param_groups:
            for p in group["params"]:
                seen[names[id(p)]] = p.grad.detach().clone()
        return original(*args, **kwargs)

    inner.step = step
    Trainer(run).run()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return seen


@pytest.mark.parametrize("method", ["finetune", "dfsft"])
def test_lora_with_checkpointing_and_accumulation_matches_the_plain_step(tmp_path, tiny_model_dir, tiny_data_path, method):
    """Batch 2 in one pass == batch 1 x 2 accumulated with gradient checkpointing (per-sample noise)."""
    common = {
        "training.loop.noise_rng": "sample",
        "training.checkpoint.save_final": False,
        "callbacks.grad_clip.max_grad_norm": 0.0,
    }
    plain = _run_and_record_grads(
        tmp_path / "plain", tiny_model_dir, tiny_data_path, method, **common, **{"training.data.train_batch_size": 2}
    )
    accumulated = _run_and_record_grads(
        tmp_path / "accum",
        tiny_model_dir,
        tiny_data_path,
        method,
        **common,
        **{
            "training.data.train_batch_size": 1,
            "training.loop.gradient_accumulation_steps": 2,
            "training.model.enable_gradient_checkpointing_type": "full",
        },
    )
    assert plain and set(plain) == set(accumulated)
    assert all(".lora_" in n for n in plain)
    assert any(g.abs().max() > 0 for g in plain.values())
    for name, grad in plain.items():
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_lora_on_a_bf16_base_keeps_fp32_adapters(tmp_path, tiny_model_dir, tiny_data_path):
    run = build_from_config(
        default_recipe("dfsft"),
        lora_overrides(
            tmp_path,
            tiny_model_dir,
            tiny_data_path,
            **{"models.student.torch_dtype": "bfloat16", "training.checkpoint.save_final": False},
        ),
    )
    model = unwrapped(run)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    summary = Trainer(run).run()
    assert summary["steps"] == 2 and torch.isfinite(torch.tensor(summary["last_loss"]))
    for n, p in model.named_parameters():
        if ".lora_" in n:
            assert p.dtype == torch.float32 and p.requires_grad, n
        else:
            # bf16 except the tables diffusers keeps in fp32 (`_keep_in_fp32_modules`); unchanged.
            assert p.dtype == base_before[n].dtype and torch.equal(p, base_before[n]), n
    assert model.blocks[0].attn1.to_q.base_layer.weight.dtype == torch.bfloat16


def test_pissa_export_is_relative_to_the_original_base(tmp_path, tiny_model_dir, tiny_data_path):
    """PiSSA rewrites the base at init; the exported LoRA (rank 2r) applies to the original base."""
    from diffusers import WanPipeline

    run = build_from_config(
        default_recipe("finetune"),
        lora_overrides(
            tmp_path,
            tiny_model_dir,
            tiny_data_path,
            **{"models.student.lora.init": "pissa", "models.student.lora.rank": 2, "models.student.lora.alpha": 3.0},
        ),
    )
    Trainer(run).run()
    out = tmp_path / "out"
    _, metadata = read_lora_file(out / DIFFUSERS_LORA_FILE)
    assert metadata["r"] == 4 and metadata["lora_alpha"] == 6.0 and metadata["init_lora_weights"] is True
    x, t, text = fixed_input()
    expected = student_prediction(run.method.student, x, t, text)
    pipe = WanPipeline.from_pretrained(tiny_model_dir)
    base_before = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    pipe.load_lora_weights(out)
    assert all(torch.equal(p, base_before[n]) for n, p in pipe.transformer.named_parameters() if n in base_before)
    got = transformer_prediction(pipe.transformer, x, t, text)
    assert (got - expected).abs().max() < 1e-5


def test_bad_target_modules_name_the_key(tmp_path, tiny_model_dir, tiny_data_path):
    with pytest.raises(ValueError, match="models.student.lora.target_modules"):
        build_from_config(
            default_recipe("finetune"),
            lora_overrides(tmp_path, tiny_model_dir, tiny_data_path, **{"models.student.lora.target_modules": ["nope"]}),
        )


def _adapter(run) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in unwrapped(run).named_parameters() if ".lora_" in n}


def _optimizer_tensors(run) -> dict[str, torch.Tensor]:
    state = run.method.optimizer.optimizer.state_dict()["state"]
    return {f"{i}/{k}": torch.as_tensor(v).clone() for i, s in state.items() for k, v in s.items()}


@pytest.mark.parametrize("storage_dtype", [None, "float8_e4m3fn"])
def test_lora_checkpoint_holds_only_the_adapter_and_resume_restores_it(tmp_path, tiny_model_dir, tiny_data_path, storage_dtype):
    """The LoRA-specific part of resume: a checkpoint without the frozen base, from which the
    adapter and the AdamW state come back bit for bit (the generic resume is tested elsewhere),
    also over a base stored in fp8 (the adapter file stays fp32)."""
    from accelerate.state import AcceleratorState, GradientState

    from fv_accel.trainer import TrainerCallback

    overrides = lora_overrides(
        tmp_path,
        tiny_model_dir,
        tiny_data_path,
        **{
            "training.loop.max_train_steps": 4,
            "training.checkpoint.training_state_checkpointing_steps": 2,
            "training.checkpoint.save_final": False,
            "models.student.storage_dtype": storage_dtype,
        },
    )
    at_step_2 = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, trainer, step, logs):
            if step == 2:
                at_step_2.update(adapter=_adapter(trainer.run_spec), optimizer=_optimizer_tensors(trainer.run_spec))

    run = build_from_config(default_recipe("finetune"), overrides, callbacks=[Snapshot()])
    Trainer(run).run()
    uninterrupted = _adapter(run)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    ckpt = tmp_path / "out" / "checkpoint-2"
    weights = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert "model.safetensors" not in weights and DIFFUSERS_LORA_FILE in weights
    transformer_bytes = (tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
    assert (ckpt / DIFFUSERS_LORA_FILE).stat().st_size < transformer_bytes / 5
    saved, _ = read_lora_file(ckpt / DIFFUSERS_LORA_FILE)
    assert saved and all(v.dtype == torch.float32 for v in saved.values())

    resumed = build_from_config(
        default_recipe("finetune"), {**overrides, "training.checkpoint.resume_from_checkpoint": str(ckpt)}
    )
    assert resumed.start_step == 2
    adapter = _adapter(resumed)
    assert set(adapter) == set(at_step_2["adapter"])
    assert all(torch.equal(adapter[n], at_step_2["adapter"][n]) for n in adapter)
    optimizer = _optimizer_tensors(resumed)
    assert set(optimizer) == set(at_step_2["optimizer"]) and optimizer
    assert all(torch.equal(optimizer[k], at_step_2["optimizer"][k]) for k in optimizer)
    Trainer(resumed).run()
    final = _adapter(resumed)
    for name, value in uninterrupted.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=0, msg=name)


def _base_bytes_by_dtype(model) -> dict[torch.dtype, int]:
    out: dict[torch.dtype, int] = {}
    for name, p in model.named_parameters():
        if ".lora_" not in name:
            out[p.dtype] = out.get(p.dtype, 0) + p.numel() * p.element_size()
    return out


def _cast_layers(model) -> list[str]:
    return [
        n for n, m in model.named_modules()
        if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook("layerwise_casting") is not None
    ]


def test_fp8_storage_halves_the_base_tracks_bf16_and_exports_a_diffusers_lora(tmp_path, tiny_model_dir, tiny_data_path):
    """models.student.storage_dtype: the cast layers (the blocks' linear layers; peft's base_layer
    where LoRA wraps one) hold half the bytes in fp8 that they hold in bf16, everything else (norms,
    embeddings, the fp32 adapter) is untouched, and the losses follow the bf16-stored run. Bound:
    fp8 e4m3 rounds these weights with a relative (Frobenius) error of 2.7% (bf16: 0.16%); over 10
    steps the losses moved at most 6.3e-4 relative to the bf16 run, so 5e-3 is the bound."""
    from accelerate.state import AcceleratorState, GradientState
    from diffusers import WanPipeline

    from fv_accel.trainer import TrainerCallback

    def run(storage_dtype):
        losses = []

        class Record(TrainerCallback):
            def on_step_end(self, trainer, step, logs):
                losses.append(float(logs["loss"]))

        overrides = lora_overrides(
            tmp_path / storage_dtype, tiny_model_dir, tiny_data_path,
            # With gradient checkpointing, as fp8 storage is meant to run (see the warning it gives without).
            **{
                "models.student.storage_dtype": storage_dtype,
                "training.loop.max_train_steps": 4,
                "training.model.enable_gradient_checkpointing_type": "full",
            },
        )
        built = build_from_config(default_recipe("finetune"), overrides, callbacks=[Record()])
        model = unwrapped(built)
        before = (_base_bytes_by_dtype(model), _cast_layers(model))
        Trainer(built).run()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return built, before, losses

    _, (bf16_bytes, bf16_layers), bf16_losses = run("bfloat16")
    fp8_run, (fp8_bytes, fp8_layers), fp8_losses = run("float8_e4m3fn")
    model = unwrapped(fp8_run)
    assert fp8_layers == bf16_layers and fp8_layers
    assert all(n.startswith("blocks.") and ".lora_" not in n and "norm" not in n for n in fp8_layers)
    assert any(n.endswith("to_q.base_layer") for n in fp8_layers) and any(n.endswith("ffn.net.2") for n in fp8_layers)
    assert set(bf16_bytes) == {torch.float32, torch.bfloat16} and set(fp8_bytes) == {torch.float32, torch.float8_e4m3fn}
    assert fp8_bytes[torch.float32] == bf16_bytes[torch.float32]
    assert 2 * fp8_bytes[torch.float8_e4m3fn] == bf16_bytes[torch.bfloat16]
    for name, p in model.named_parameters():
        if ".lora_" in name:
            assert p.dtype == torch.float32 and p.requires_grad, name
    assert len(fp8_losses) == len(bf16_losses) == 4
    rel = max(abs(a - b) / abs(b) for a, b in zip(fp8_losses, bf16_losses))
    assert rel < 5e-3, (fp8_losses, bf16_losses)

    # The exported adapter (fp32) loads into a stock WanPipeline; with the same fp8 storage there,
    # it reproduces the student.
    out = tmp_path / "float8_e4m3fn" / "out"
    state, _ = read_lora_file(out / DIFFUSERS_LORA_FILE)
    assert state and all(v.dtype == torch.float32 for v in state.values())
    x, t, text = fixed_input()
    expected = student_prediction(fp8_run.method.student, x, t, text)
    pipe = WanPipeline.from_pretrained(tiny_model_dir)
    pipe.load_lora_weights(out)
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    got = transformer_prediction(pipe.transformer, x, t, text)
    assert (got - expected).abs().max() < 1e-5
