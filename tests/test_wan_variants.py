"""The Wan family's variants end to end on their tiny models: preprocess tiny clips with the model's
own VAE/encoders, train (FineTune with LoRA, DFSFT full), save, and load the result with the stock
diffusers pipeline of that repo; plus the image-to-video and expert rules at the method level."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fv_accel.build import build_from_config
from fv_accel.config import default_recipe, load_config
from fv_accel.methods import METHODS
from fv_accel.models import build_student
from fv_accel.trainer import Trainer
from family_helpers import run_overrides

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
VARIANTS = ["wan21_i2v", "wan22_ti2v", "wan22_t2v_a14b", "wan22_i2v_a14b"]
EXPERT = {"wan22_t2v_a14b": "low_noise", "wan22_i2v_a14b": "low_noise"}


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory):
    """name -> (tiny model folder, its preprocessed dataset of 2 clips of 17 frames at 64x64)."""
    from fv_accel.data.video import FrameSampling
    from fv_accel.preprocess import preprocess
    from fv_accel.tiny.data import write_tiny_videos
    from fv_accel.tiny.model import write_tiny_variant

    root = tmp_path_factory.mktemp("variants")
    clips = root / "clips"
    write_tiny_videos(clips, num_clips=2, num_frames=17, height=64, width=64, seed=0)
    out = {}
    for name in VARIANTS:
        model = write_tiny_variant(root / name, name, seed=0)
        sampling = FrameSampling(num_frames=(17,), buckets=((64, 64),), seed=0)
        result = preprocess(str(model), str(clips), root / f"{name}-data", sampling, device=CPU, dtype=torch.float32)
        assert result.encoded == 2, result.summary
        out[name] = (model, root / f"{name}-data")
    return out


def overrides(tmp: Path, model: Path, data: Path, name: str, **extra):
    """run_overrides, with the expert a two-expert variant trains."""
    expert = {"models.student.expert": EXPERT[name]} if name in EXPERT else {}
    return run_overrides(tmp, model, data, **{**expert, **extra})


def load_stock_pipeline(model: Path):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(str(model))


@pytest.mark.parametrize("name", VARIANTS)
def test_lora_finetune_loads_into_the_stock_pipeline_and_changes_its_weights(tmp_path, variant_dirs, name):
    model, data = variant_dirs[name]
    run = build_from_config(default_recipe("finetune"), overrides(tmp_path, model, data, name, **{"models.student.lora.enable": True}))
    Trainer(run).run()
    lora_dir = tmp_path / "out"
    assert (lora_dir / "pytorch_lora_weights.safetensors").is_file()
    pipe = load_stock_pipeline(model)
    target = "transformer_2" if EXPERT.get(name) == "low_noise" else "transformer"
    other = "transformer" if target == "transformer_2" else "transformer_2"
    before = {k: v.clone() for k, v in getattr(pipe, target).state_dict().items()}
    before_other = None if getattr(pipe, other, None) is None else {k: v.clone() for k, v in getattr(pipe, other).state_dict().items()}
    kwargs = {"load_into_transformer_2": True} if target == "transformer_2" else {}
    pipe.load_lora_weights(str(lora_dir), adapter_name="trained", **kwargs)
    pipe.fuse_lora(components=[target], lora_scale=1.0)
    pipe.unload_lora_weights()
    after = getattr(pipe, target).state_dict()
    changed = [k for k in before if "to_q" in k and not torch.equal(before[k], after[k])]
    assert changed, f"the LoRA changed no attention weight of {target}"
    if before_other is not None:
        assert all(torch.equal(v, getattr(pipe, other).state_dict()[k]) for k, v in before_other.items())
    if target == "transformer_2":
        # A low-noise expert's merged export: its LoRA on the base's low-noise expert, as transformer_2/.
        from diffusers import WanTransformer3DModel

        from fv_accel.export import main as export_main

        export_main([str(lora_dir), "--to", "merged", "--out", str(tmp_path / "merged")])
        merged = WanTransformer3DModel.from_pretrained(tmp_path / "merged", subfolder="transformer_2")
        assert max(float((v - after[k]).abs().max()) for k, v in merged.state_dict().items()) <= 1e-6


@pytest.mark.parametrize("name", VARIANTS)
def test_dfsft_trains_saves_and_the_stock_pipeline_loads_the_transformer(tmp_path, variant_dirs, name):
    from diffusers import WanTransformer3DModel

    model, data = variant_dirs[name]
    over = overrides(tmp_path, model, data, name, **{"method.chunk_size": 2})
    run = build_from_config(default_recipe("dfsft"), over)
    Trainer(run).run()
    sub = "transformer_2" if EXPERT.get(name) == "low_noise" else "transformer"
    saved = WanTransformer3DModel.from_pretrained(str(tmp_path / "out"), subfolder=sub)
    base = WanTransformer3DModel.from_pretrained(str(model), subfolder=sub)
    assert saved.config.in_channels == base.config.in_channels
    assert any(not torch.equal(a, b) for a, b in zip(saved.state_dict().values(), base.state_dict().values()))
    pipe = load_stock_pipeline(model)
    setattr(pipe, sub, saved)  # the stock pipeline takes the trained transformer as is


def student_and_method(model: Path, recipe: str, name: str, **extra):
    over = {"models.student.init_from": str(model), "callbacks.validation.enable": False}
    if name in EXPERT:
        over["models.student.expert"] = EXPERT[name]
    over.update(extra)
    cfg = load_config(default_recipe(recipe), over)
    torch.manual_seed(0)
    student = build_student(cfg)
    return student, METHODS[cfg.method.name](cfg=cfg, role_models={"student": student})


def one_batch(data: Path):
    from fv_accel.data.loader import LatentDataset

    item = LatentDataset(str(data))[(0, 0, 0)]
    return {k: (v[None] if isinstance(v, torch.Tensor) else v) for k, v in item.items()} | {
        "sample_index": torch.tensor([0]),
        "epoch": torch.tensor([0]),
    }


@pytest.mark.parametrize("recipe", ["finetune", "dfsft"])
def test_ti2v_image_to_video_keeps_the_condition_frame_clean_at_t0_without_loss(variant_dirs, recipe):
    model, data = variant_dirs["wan22_ti2v"]
    student, method = student_and_method(model, recipe, "wan22_ti2v", **{"models.student.task": "i2v", "method.chunk_size": 2})
    assert student.in_channels == 48 and student.capabilities.image_conditioning
    _, outputs, _ = method.single_train_step(one_batch(data), 0)
    tb = outputs["training_batch"]
    assert tb.conditioning.clean_frames == 1
    assert torch.equal(tb.noisy_model_input[:, :, 0], tb.latents[:, :, 0])
    assert not torch.equal(tb.noisy_model_input[:, :, 1], tb.latents[:, :, 1])
    assert tb.timesteps.shape == (1, tb.latents.shape[2]) and float(tb.timesteps[0, 0]) == 0.0
    assert int(tb.timestep_indices[0, 0]) == -1 and bool((tb.timesteps[0, 1:] > 0).all())
    # the condition frame carries no loss: any prediction there leaves the loss unchanged
    pred = torch.randn_like(tb.latents)
    loss = method.compute_loss(pred, tb) if recipe == "dfsft" else method.unweighted_loss(pred, tb)
    pred[:, :, 0] += 100.0
    again = method.compute_loss(pred, tb) if recipe == "dfsft" else method.unweighted_loss(pred, tb)
    assert float(loss) == float(again)


@pytest.mark.parametrize("name", ["wan21_i2v", "wan22_i2v_a14b"])
def test_channel_concat_i2v_input_is_noisy_mask_and_first_frame_latent(variant_dirs, name):
    model, data = variant_dirs[name]
    student, method = student_and_method(model, "finetune", name)
    batch = one_batch(data)
    cond = student.build_conditioning(batch)
    x = torch.randn(1, student.in_channels, *batch["vae_latent"].shape[2:])
    model_in = student.model_input(x, cond)
    assert model_in.shape[1] == student.transformer.config.in_channels == 2 * student.in_channels + 4
    assert torch.equal(model_in[:, : student.in_channels], x)
    mask = model_in[:, student.in_channels : student.in_channels + 4]
    assert bool((mask[:, :, 0] == 1).all()) and bool((mask[:, :, 1:] == 0).all())
    expected = batch["first_frame_latent"].float()  # stored normalised, as FastVideo writes it
    assert torch.equal(model_in[:, student.in_channels + 4 :], expected)
    assert (cond.image is not None) == (name == "wan21_i2v")
    loss_map, _, _ = method.single_train_step(batch, 0)
    assert math.isfinite(float(loss_map["total_loss"]))


def test_an_expert_trains_only_its_side_of_the_boundary(variant_dirs):
    model, _ = variant_dirs["wan22_t2v_a14b"]
    high, method = student_and_method(model, "finetune", "wan22_t2v_a14b", **{"models.student.expert": "high_noise"})
    assert high.layout.boundary_ratio == 0.875
    idx = method.sample_homogeneous_indices(2000, torch.Generator().manual_seed(0), CPU)
    assert float(method.table.timesteps_at(idx).min()) >= 875.0
    _, low = student_and_method(model, "dfsft", "wan22_t2v_a14b")
    idx = low.table.sample_chunk_indices(8, 6, 2, low._timestep_index_range, torch.Generator().manual_seed(0), CPU)
    assert float(low.table.timesteps_at(idx).max()) < 875.0
    with pytest.raises(ValueError, match="outside the student's range"):
        student_and_method(model, "finetune", "wan22_t2v_a14b", **{"method.min_timestep_ratio": 0.05})


def test_a_two_expert_repo_needs_an_expert_and_a_one_transformer_repo_refuses_one(variant_dirs):
    model, _ = variant_dirs["wan22_t2v_a14b"]
    with pytest.raises(ValueError, match="set models.student.expert to high_noise, low_noise or both"):
        student_and_method(model, "finetune", "x")
    ti2v, _ = variant_dirs["wan22_ti2v"]
    with pytest.raises(ValueError, match="has one transformer"):
        student_and_method(ti2v, "finetune", "x", **{"models.student.expert": "high_noise"})


def test_both_experts_route_each_sample_and_frame_and_leave_the_other_expert_untouched(variant_dirs):

    model, data = variant_dirs["wan22_t2v_a14b"]
    student, _ = student_and_method(model, "finetune", "x", **{"models.student.expert": "both"})
    pair, b = student.transformer, student.boundary_timestep
    one = one_batch(data)
    batch = {k: (torch.cat([v, v]) if isinstance(v, torch.Tensor) else v) for k, v in one.items()}
    x = torch.randn(2, *one["vae_latent"].shape[1:], generator=torch.Generator().manual_seed(0))
    cond = student.build_conditioning(batch)
    t = torch.tensor([b + 10.0, b - 10.0])
    with torch.no_grad():
        routed = student.forward(x, t, cond)
        high = student._expert_forward("high_noise", x[:1], t[:1], cond.select(torch.tensor([0])))
        low = student._expert_forward("low_noise", x[1:], t[1:], cond.select(torch.tensor([1])))
        assert torch.equal(routed[0], high[0]) and torch.equal(routed[1], low[0])
        frames = x.shape[2]
        per_frame = torch.tensor([[b + 5.0] * frames, [b - 5.0] * (frames - 1) + [b + 5.0]])
        routed = student.forward(x, per_frame, cond)
        all_high = student._expert_forward("high_noise", x, per_frame, cond)
        all_low = student._expert_forward("low_noise", x, per_frame, cond)
    assert torch.equal(routed[0], all_high[0])
    assert torch.equal(routed[1, :, :-1], all_low[1, :, :-1]) and torch.equal(routed[1, :, -1], all_high[1, :, -1])
    # a step whose samples are all high-noise changes the high expert only, bit for bit
    low_before = {k: v.clone() for k, v in pair.low.state_dict().items()}
    high_before = {k: v.clone() for k, v in pair.high.state_dict().items()}
    opt = torch.optim.AdamW(student.trainable_parameters(), lr=1e-3, weight_decay=0.01)
    student.forward(x, torch.tensor([b + 10.0, b + 50.0]), cond).pow(2).mean().backward()
    opt.step()
    assert all(torch.equal(v, pair.low.state_dict()[k]) for k, v in low_before.items())
    assert any(not torch.equal(v, pair.high.state_dict()[k]) for k, v in high_before.items())


def fused_by_diffusers(model: Path, lora_dir: Path):
    """The stock pipeline of `model` with the two experts' LoRA files of `lora_dir` loaded by diffusers
    (`pytorch_lora_weights.safetensors` into transformer, `..._transformer_2` into transformer_2) and fused."""
    pipe = load_stock_pipeline(model)
    pipe.load_lora_weights(str(lora_dir), adapter_name="high")
    pipe.load_lora_weights(
        str(lora_dir), weight_name="pytorch_lora_weights_transformer_2.safetensors", adapter_name="low",
        load_into_transformer_2=True,
    )
    pipe.fuse_lora(components=["transformer", "transformer_2"], lora_scale=1.0)
    pipe.unload_lora_weights()
    return pipe


def test_both_experts_lora_run_writes_one_file_per_expert_that_diffusers_loads(tmp_path, variant_dirs):
    from diffusers import WanPipeline, WanTransformer3DModel
    from safetensors.torch import load_file

    from fv_accel.export import main as export_main
    from fv_accel.models.lora import read_lora_file

    model, data = variant_dirs["wan22_t2v_a14b"]
    over = overrides(tmp_path, model, data, "x", **{"models.student.lora.enable": True, "models.student.expert": "both",
                                                      "training.data.train_batch_size": 2,
                                                      "training.checkpoint.training_state_checkpointing_steps": 1})
    over["training.data.data_path"] = str(data)
    Trainer(build_from_config(default_recipe("finetune"), over)).run()
    out = tmp_path / "out"
    base = load_stock_pipeline(model)
    pipe = fused_by_diffusers(model, out)
    for module, old in zip((pipe.transformer, pipe.transformer_2), (base.transformer, base.transformer_2)):
        old = old.state_dict()
        assert any(not torch.equal(v, module.state_dict()[k]) for k, v in old.items() if "to_q.weight" in k)

    # `python -m fv_accel.export` exports both experts: one ComfyUI file each (the files training
    # wrote) and both merged transformers in the repo's layout, from the run's two LoRA files and
    # from a checkpoint's one (keys prefixed by the expert).
    export_main([str(out), "--to", "comfyui", "--out", str(tmp_path / "comfy")])
    assert sorted(p.name for p in (tmp_path / "comfy").iterdir()) == [
        "pytorch_lora_weights_comfyui_high_noise.safetensors", "pytorch_lora_weights_comfyui_low_noise.safetensors"
    ]
    for expert, trained in (("high_noise", ""), ("low_noise", "_transformer_2")):
        exported = load_file(str(tmp_path / "comfy" / f"pytorch_lora_weights_comfyui_{expert}.safetensors"))
        written = load_file(str(out / f"pytorch_lora_weights_comfyui{trained}.safetensors"))
        assert exported.keys() == written.keys() and all(torch.equal(exported[k], written[k]) for k in written)
    # A checkpoint's one file (keys prefixed by the expert) exports as the run's two diffusers files.
    state, _ = read_lora_file(out / "checkpoint-1" / "pytorch_lora_weights.safetensors")
    assert {k.split(".")[0] for k in state} == {"high_noise", "low_noise"}
    export_main([str(out / "checkpoint-1"), "--to", "diffusers", "--out", str(tmp_path / "ckpt_lora")])
    for expert, name in (("high_noise", ""), ("low_noise", "_transformer_2")):
        part, _ = read_lora_file(tmp_path / "ckpt_lora" / f"pytorch_lora_weights{name}.safetensors")
        assert len(part) == len(state) // 2 and all(torch.equal(v, state[f"{expert}.{k}"]) for k, v in part.items())
    for source, reference in ((out, pipe), (out / "checkpoint-1", fused_by_diffusers(model, tmp_path / "ckpt_lora"))):
        dest = tmp_path / f"merged_{source.name}"
        export_main([str(source), "--to", "merged", "--out", str(dest)])
        merged = WanPipeline.from_pretrained(
            str(model), transformer=WanTransformer3DModel.from_pretrained(dest, subfolder="transformer"),
            transformer_2=WanTransformer3DModel.from_pretrained(dest, subfolder="transformer_2"),
        )
        for fused, loaded in ((reference.transformer, merged.transformer), (reference.transformer_2, merged.transformer_2)):
            expected = fused.state_dict()
            assert max(float((v - expected[k]).abs().max()) for k, v in loaded.state_dict().items()) <= 1e-6
    assert not torch.equal(merged.transformer.blocks[0].attn1.to_q.weight, pipe.transformer.blocks[0].attn1.to_q.weight)


def test_dmd2_ti2v_image_to_video_feeds_every_role_the_clean_condition_frame_at_t0(tmp_path, variant_dirs):
    """A TI2V image-to-video DMD2 run (simulate): the student, teacher and critic each see the data's
    first latent frame clean at timestep 0 in every forward, and the student trains."""
    from dmd2_helpers import DMD2_RECIPE, dmd2_overrides

    model, data = variant_dirs["wan22_ti2v"]
    over = dmd2_overrides(tmp_path, **{
        "models.teacher.init_from": str(model), "models.teacher.transformer_config": None,
        "models.teacher.task": "i2v", "models.student.task": "i2v", "models.critic.task": "i2v",
        "training.data.data_path": str(data), "training.data.train_batch_size": 1,
        "training.data.text_max_length": 512, "training.loop.max_train_steps": 2,
        "method.generator_update_interval": 1,
    })
    run = build_from_config(DMD2_RECIPE, over)
    method = run.method
    assert method.student.capabilities.image_conditioning
    seen = []
    current = {}
    original = method._prepare_dmd_batch

    def prepare(batch):
        tb = original(batch)
        current["first"] = tb.extras["clean_condition"].clone()
        return tb

    method._prepare_dmd_batch = prepare
    for role in ("student", "teacher", "critic"):
        model_role = getattr(method, role)
        real = model_role.forward

        def forward(x, t, cond, _real=real, _role=role):
            seen.append((_role, torch.equal(x[:, :, :1], current["first"]), t.detach().clone()))
            return _real(x, t, cond)

        model_role.forward = forward
    before = {k: v.clone() for k, v in method.student.transformer.state_dict().items()}
    summary = Trainer(run).run()
    assert summary["steps"] == 2 and summary["skipped_steps"] == 0
    assert {r for r, _, _ in seen} == {"student", "teacher", "critic"}
    for role, clean_first, t in seen:
        assert clean_first, role
        assert t.ndim == 2 and torch.all(t[:, 0] == 0) and torch.all(t[:, 1:] > 0), role
    after = method.student.transformer.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_nft_ti2v_image_to_video_samples_and_trains_with_each_prompts_clean_condition_frame(tmp_path, variant_dirs):
    """A TI2V image-to-video DiffusionNFT run: every forward of the student, the old policy and the
    reference (sampling and training) sees the prompt row's own first latent frame clean at timestep
    0, the samples keep it, and the student trains."""
    from test_nft import NFT_RECIPE, nft_overrides

    model, data = variant_dirs["wan22_ti2v"]
    over = nft_overrides(tmp_path, str(data), **{
        "models.student.transformer_config": None, "models.student.init_from": str(model), "models.student.task": "i2v",
        "training.data.text_max_length": 512, "method.sample_train_batch_size": 2, "method.num_batches_per_epoch": 1,
        "training.loop.max_train_steps": 1,
    })
    run = build_from_config(NFT_RECIPE, over)
    method = run.method
    clean = {}
    original = method.sampling_batch

    def sampling_batch(batch):
        tb, shape = original(batch)
        clean["first"] = tb.conditioning.extras["clean_condition"].clone()
        return tb, shape

    method.sampling_batch = sampling_batch
    seen = []
    for name, role in (("student", method.student), ("old", method.old), ("reference", method.reference)):
        real = role.forward

        def forward(x, t, cond, _real=real, _name=name):
            seen.append((_name, t.detach().clone(), x[:, :, :1].detach().clone()))
            return _real(x, t, cond)

        role.forward = forward
    before = {k: v.clone() for k, v in method.student.transformer.state_dict().items()}
    summary = Trainer(run).run()
    assert summary["steps"] == 1
    assert {n for n, _, _ in seen} == {"student", "old", "reference"}
    for name, t, first in seen:
        assert t.ndim == 2 and torch.all(t[:, 0] == 0) and torch.all(t[:, 1:] > 0), name
    # The sampler's forwards (the old policy's first 2, at 2 steps) see the batch's condition frames
    # exactly; every training forward sees, for each sample, one of them (the sample's own).
    sampling = [first for name, _, first in seen if name == "old"][:2]
    assert all(torch.equal(f, clean["first"].to(f.dtype)) for f in sampling)
    conditions = clean["first"].flatten(1)
    for name, _, first in seen[2:]:
        for row in first.flatten(1):
            assert any(torch.equal(row, c.to(row.dtype)) for c in conditions), name
    after = method.student.transformer.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_nft_ti2v_held_out_validation_samples_with_each_prompts_condition_frame(tmp_path, variant_dirs):
    """Reward training's held-out validation of an image-to-video student: its prompts' rows give
    their own clean first frames (as the training sampler's do), for the reference at the start and
    the student at the last step."""
    from test_nft import NFT_RECIPE, nft_overrides

    model, data = variant_dirs["wan22_ti2v"]
    over = nft_overrides(tmp_path, str(data), **{
        "models.student.transformer_config": None, "models.student.init_from": str(model), "models.student.task": "i2v",
        "training.data.text_max_length": 512, "method.sample_train_batch_size": 2, "method.num_batches_per_epoch": 1,
        "training.loop.max_train_steps": 1, "method.validation.every_steps": 1, "method.validation.data_path": str(data),
        "method.validation.num_prompts": 2, "method.validation.num_steps": 2,
    })
    run = build_from_config(NFT_RECIPE, over)
    firsts = []
    real = run.method.reference.forward

    def forward(x, t, cond):
        firsts.append((x[:, :, :1].detach().clone(), t.detach().clone()))
        return real(x, t, cond)

    run.method.reference.forward = forward
    summary = Trainer(run).run()
    held = {k: v for k, v in summary.items() if k.startswith("held-out reward/tiny_speed")}
    assert held and all(math.isfinite(v) for v in held.values()), summary
    # The reference's validation forwards come first: each sees one of the two rows' first latent frames.
    from fv_accel.data.loader import LatentDataset

    rows = LatentDataset(str(data), text_max_length=512)
    conditions = [run.method.student.clean_latents({"vae_latent": rows[(i, 0, 0)]["vae_latent"][None]})[:, :, :1]
                  for i in range(2)]
    x, t = firsts[0]
    assert torch.all(t[:, 0] == 0)
    assert any(torch.equal(x[:1], c.to(x.dtype)) for c in conditions)
