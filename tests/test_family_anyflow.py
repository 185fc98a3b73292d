"""The AnyFlow family on its tiny model (fv_accel/tiny/anyflow.py), against diffusers' own AnyFlowPipeline
and FlowMapEulerDiscreteScheduler, offline: the flow-map contract (`predict_velocity_with_r`), the
training forward against the pipeline's transformer call, the student made from a Wan transformer, and
run folders that the stock pipeline samples (in a subprocess without fv_accel) exactly as our
validation sampler does, at 1, 2 and 4 steps."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from family_helpers import preprocess_tiny_clips, run_overrides

PROMPT = 'a red  ball\nmoving "left" &amp; the blue box'
TEXT_LENGTH = 16  # the tiny runs' text length (the pipeline's max_sequence_length in the comparisons)


@pytest.fixture(scope="module")
def af_dir(tiny_model_of):
    return tiny_model_of("anyflow")


@pytest.fixture(scope="module")
def af_pipe(af_dir):
    from diffusers import AnyFlowPipeline

    pipe = AnyFlowPipeline.from_pretrained(str(af_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def student_of(model, **overrides):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.models import build_student

    cfg = load_config(default_recipe("finetune"), {"models.student.init_from": str(model), **overrides})
    torch.manual_seed(0)
    student = build_student(cfg)
    student.init_preprocessors(cfg.training)
    return student


def test_tiny_model_has_the_real_repo_layout_and_the_stock_pipeline_samples_it(af_dir, af_pipe):
    from diffusers import AnyFlowTransformer3DModel, FlowMapEulerDiscreteScheduler

    index = json.loads((af_dir / "model_index.json").read_text())
    assert index["_class_name"] == "AnyFlowPipeline"
    assert index["transformer"] == ["diffusers", "AnyFlowTransformer3DModel"]
    assert index["scheduler"] == ["diffusers", "FlowMapEulerDiscreteScheduler"]
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"] and index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    config = af_pipe.transformer.config
    assert isinstance(af_pipe.transformer, AnyFlowTransformer3DModel)
    assert isinstance(af_pipe.scheduler, FlowMapEulerDiscreteScheduler) and af_pipe.scheduler.config.shift == 5.0
    assert (config.gate_value, config.deltatime_type, config.cross_attn_norm) == (0.25, "r", True)
    assert tuple(config.patch_size) == (1, 2, 2) and config.in_channels == config.out_channels == 16
    emb = af_pipe.transformer.condition_embedder
    assert not torch.equal(emb.delta_embedder.linear_1.weight, emb.time_embedder.linear_1.weight)
    latents = af_pipe(prompt="a red ball", height=32, width=32, num_frames=5, num_inference_steps=2,
                      output_type="latent", generator=torch.Generator().manual_seed(0)).frames
    assert latents.shape == (1, 16, 2, 4, 4) and bool(torch.isfinite(latents).all())


def test_training_forward_is_the_pipelines_transformer_call_with_t_and_r(af_dir, af_pipe, tmp_path):
    """The pipeline at 2 steps with guidance (one call of batch 2: [negative, prompt]); training's
    inputs from the loader (kept, and dropped by caption dropout) and `predict_velocity_with_r` at the
    pipeline's t and r give its inputs and output within 1e-6."""
    from test_pipeline_consistency import input_differences, loader_batches, record_pipeline

    from fv_accel.models.base import TrainingBatch

    ((_, theirs, output),) = record_pipeline(
        af_pipe, {"transformer": af_pipe.transformer}, 1, prompt=PROMPT, height=32, width=32, num_frames=5,
        num_inference_steps=2, guidance_scale=2.0, max_sequence_length=TEXT_LENGTH,
    )
    kept, dropped, _ = loader_batches(tmp_path, af_dir, text_max_length=TEXT_LENGTH)
    student = student_of(af_dir)
    x_t = theirs["hidden_states"][1:].permute(0, 2, 1, 3, 4)
    t, r = theirs["timestep"][1:, 0].float(), theirs["r_timestep"][1:, 0].float()
    assert float(t) > float(r) > 0  # the first of 2 steps: r is the next timestep
    for row, batch in ((1, kept), (0, dropped)):
        seen: list = []
        hook = student.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(dict(k)), with_kwargs=True)
        with torch.no_grad():
            tb = TrainingBatch(conditioning=student.build_conditioning(batch))
            out = student.predict_velocity_with_r(x_t, t, r, tb)
        hook.remove()
        diffs = input_differences(theirs, seen[0], row)
        diffs["output"] = float((out - output[row : row + 1].permute(0, 2, 1, 3, 4)).abs().max())
        assert set(diffs) >= {"hidden_states", "timestep", "r_timestep", "encoder_hidden_states", "output"}
        assert max(diffs.values()) <= 1e-6, diffs


def test_the_flow_map_contract(af_dir):
    """predict_noise is r = t; timesteps [1], [B] and [B, T] agree; r changes the output; one Euler step
    of the flow map is FlowMapEulerDiscreteScheduler.step's."""
    from diffusers import FlowMapEulerDiscreteScheduler

    from fv_accel.models.base import Conditioning, TrainingBatch

    student = student_of(af_dir)
    torch.manual_seed(1)
    x = torch.randn(2, 16, 3, 4, 4)
    tb = TrainingBatch(conditioning=Conditioning(text=torch.randn(2, 6, 32)))
    t, r = torch.tensor([700.0, 700.0]), torch.tensor([300.0, 300.0])
    with torch.no_grad():
        u = student.predict_velocity_with_r(x, t, r, tb)
        assert torch.equal(student.predict_noise(x, t, tb), student.predict_velocity_with_r(x, t, t, tb))
        assert torch.equal(u, student.predict_velocity_with_r(x, t[:1], r[:1], tb))
        assert torch.equal(u, student.predict_velocity_with_r(x, t[:, None].expand(2, 3), r[:, None].expand(2, 3), tb))
        assert torch.equal(u, student.predict_velocity_with_r(x, t.long(), r.long(), tb))
        assert float((u - student.predict_noise(x, t, tb)).abs().max()) > 1e-3
        uncond = student.predict_velocity_with_r(x, t, r, tb, conditional=False)
    assert float((u - uncond).abs().max()) > 1e-4
    scheduler = FlowMapEulerDiscreteScheduler(shift=1.0)
    scheduler.set_timesteps(timesteps=[700.0, 300.0])
    stepped = scheduler.step(u, torch.tensor(700.0), x, r_timestep=torch.tensor(300.0), return_dict=False)[0]
    torch.testing.assert_close(stepped, x - (700.0 - 300.0) / 1000 * u, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"r_timesteps must be \[B\], \[1\] or \[B, T=3\]"):
        student.predict_velocity_with_r(x, t, torch.zeros(2, 5), tb)


def test_a_wan_transformer_becomes_an_anyflow_student_that_equals_it_at_r_equal_t(tiny_model_of):
    """anyflow_from_wan: every Wan weight carried over by name, the delta embedder a copy of the time
    embedder, gate and deltatime from the recipe; at r = t the flow map is the Wan model's velocity.
    With models.student.causal an AnyFlow-FAR student, its compressed patch embedding diffusers' warm
    start from the patch embedding; it trains on the CPU. What diffusers' AnyFlow transformer cannot
    hold is refused in one line."""
    from fv_accel.config import ConfigError
    from fv_accel.models.anyflow import pipeline_timesteps
    from fv_accel.models.base import Conditioning, TrainingBatch

    wan_dir = tiny_model_of("wan21_t2v")
    wan = student_of(wan_dir)
    af = student_of(wan_dir, **{"models.student.anyflow_from_wan": True, "models.student.r_embedder_gate_value": 0.4,
                                "models.student.r_embedder_deltatime_type": "t-r"})
    assert type(af).__name__ == "AnyFlowStudent" and type(af.transformer).__name__ == "AnyFlowTransformer3DModel"
    assert (af.transformer.config.gate_value, af.transformer.config.deltatime_type) == (0.4, "t-r")
    theirs, ours = wan.transformer.state_dict(), af.transformer.state_dict()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert set(ours) - set(theirs) == {k for k in ours if k.startswith("condition_embedder.delta_embedder.")} != set()
    emb = af.transformer.condition_embedder
    assert all(torch.equal(v, emb.time_embedder.state_dict()[k]) for k, v in emb.delta_embedder.state_dict().items())
    same = student_of(wan_dir, **{"models.student.anyflow_from_wan": True})  # deltatime r: delta(r = t) = time(t)
    torch.manual_seed(2)
    x, t, cond = torch.randn(1, 16, 2, 4, 4), torch.tensor([600.0]), Conditioning(text=torch.randn(1, 5, 32))
    with torch.no_grad():
        torch.testing.assert_close(same.forward(x, t, cond), wan.forward(x, t, cond), rtol=0, atol=1e-5)
    far = student_of(wan_dir, **{"models.student.anyflow_from_wan": True, "models.student.causal": True})
    assert type(far).__name__ == "AnyFlowFARStudent" and type(far.transformer).__name__ == "AnyFlowFARTransformer3DModel"
    ours = far.transformer.state_dict()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    full, compressed = far.transformer.patch_embedding, far.transformer.far_patch_embedding
    warm = torch.nn.functional.interpolate(full.weight.reshape(-1, 1, 1, 2, 2), size=(1, 4, 4), mode="trilinear")
    torch.testing.assert_close(compressed.weight, warm.reshape(compressed.weight.shape), rtol=0, atol=0)
    torch.testing.assert_close(compressed.bias, full.bias, rtol=0, atol=0)
    far.predict_noise(x, t, TrainingBatch(conditioning=cond)).sum().backward()
    assert float(far.transformer.condition_embedder.delta_embedder.linear_1.weight.grad.abs().sum()) > 0
    with pytest.raises((ValueError, ConfigError), match="r_embedder_fusion: additive"):
        student_of(wan_dir, **{"models.student.anyflow_from_wan": True, "models.student.r_embedder_fusion": "additive"})
    with pytest.raises(ValueError, match="image_dim.*text-to-video"):
        student_of(tiny_model_of("wan21_i2v"), **{"models.student.anyflow_from_wan": True})
    # FastVideo's pinned list [999, 937, 833, 624, 0] at shift 5: what the stock pipeline must be given.
    from diffusers import FlowMapEulerDiscreteScheduler

    scheduler = FlowMapEulerDiscreteScheduler(shift=5.0)
    scheduler.set_timesteps(timesteps=pipeline_timesteps([999, 937, 833, 624, 0], 5.0))
    torch.testing.assert_close(scheduler.timesteps, torch.tensor([999.0, 937.0, 833.0, 624.0], dtype=torch.float64))


def test_a_loaded_checkpoint_keeps_its_own_gate(af_dir):
    with pytest.raises(ValueError, match="r_embedder_gate_value: 0.5, but the AnyFlow checkpoint"):
        student_of(af_dir, **{"models.student.r_embedder_gate_value": 0.5})


# ---- run folders the stock pipeline samples ----

STOCK_SAMPLER = textwrap.dedent(
    """
    import json, sys
    import torch
    from diffusers import DiffusionPipeline
    jobs, steps, size, frames, length, prompt = json.loads(sys.argv[1]), json.loads(sys.argv[2]), *map(int, sys.argv[3:6]), sys.argv[6]
    out = {}
    for name, (folder, lora) in jobs.items():
        pipe = DiffusionPipeline.from_pretrained(folder)
        assert type(pipe).__name__ == ("AnyFlowFARPipeline" if name == "far" else "AnyFlowPipeline")
        pipe.set_progress_bar_config(disable=True)
        if lora is not None:
            pipe.load_lora_weights(lora)
        for n in steps:
            latents = pipe(prompt=prompt, height=size, width=size, num_frames=frames, num_inference_steps=n,
                           max_sequence_length=length, output_type="latent", generator=torch.Generator().manual_seed(3)).frames
            out[f"{name}/{n}"] = latents.flatten().tolist()
    print("FV_ACCEL_ABSENT" if not any(m.startswith("fv_accel") for m in sys.modules) else "FV_ACCEL_IMPORTED")
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def af_data(af_dir, tmp_path_factory):
    return preprocess_tiny_clips(af_dir, tmp_path_factory.mktemp("af_data"))


@pytest.fixture(scope="module")
def far_dir(tiny_model_of):
    return tiny_model_of("anyflow_far")


@pytest.fixture(scope="module")
def far_data(far_dir, tmp_path_factory):
    return preprocess_tiny_clips(far_dir, tmp_path_factory.mktemp("far_data"))


def validation_latents(run_cfg, student, steps: list[int], size: int, frames: int) -> dict[int, torch.Tensor]:
    """Our validation sampler (VideoSamplingCallback._sample_latents) on the run's student, seed 3."""
    import dataclasses
    import types

    from fv_accel.validation import SamplePrompt, VideoSamplingCallback

    callback = VideoSamplingCallback(run_cfg, run_cfg.training.data.data_path)
    method = types.SimpleNamespace(chunk_size=None, student=student)
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(device=torch.device("cpu")), method=method)
    callback.prompts = [SamplePrompt(prompt=PROMPT, negative_prompt="", height=size, width=size, num_frames=frames,
                                     sampling_steps=1, guidance_scale=1.0, seed=3, name="p")]
    callback._load(trainer)
    with torch.no_grad():
        return {n: callback._sample_latents(trainer, student, dataclasses.replace(callback.prompts[0], sampling_steps=n))
                for n in steps}


def train_two_steps(af_dir, af_data, tmp_path, **extra):
    """2 finetune steps (flow matching at r = t) of the tiny AnyFlow student into tmp_path/out."""
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    extra = {"training.data.text_max_length": TEXT_LENGTH, "training.optimizer.learning_rate": 1e-2,
             "training.optimizer.lr_warmup_steps": 0, **extra}
    run = build_from_config(default_recipe("finetune"), run_overrides(tmp_path, af_dir, af_data, **extra))
    before = {k: v.clone() for k, v in run.method.student.transformer.state_dict().items()}
    assert Trainer(run).run()["steps"] == 2
    after = run.method.student.transformer.state_dict()
    assert max(float((after[k] - v).abs().max()) for k, v in before.items()) > 0
    return run, tmp_path / "out"


@pytest.mark.slow
def test_the_stock_pipelines_sample_the_runs_as_our_validation_sampler_does(
    af_dir, af_data, far_dir, far_data, tiny_model_of, tmp_path
):
    """A full and a LoRA run of the tiny AnyFlow student, a LoRA run of one made from the tiny Wan, and a
    full run of the tiny AnyFlow-FAR one: the full runs' folders (pipeline folders of their own:
    AnyFlowPipeline, AnyFlowFARPipeline), the LoRA file over the base repo, and the from-Wan LoRA run's
    folder (its AnyFlow base written beside the file), sampled by diffusers in a subprocess that never
    imports fv_accel,
    give our validation sampler's latents at 1, 2 and 4 steps (1e-4); the FAR one chunk by chunk over
    its KV cache at the model's own chunk_partition (17 frames: chunks of 1, 2 and 2 latent frames)."""
    full, full_out = train_two_steps(af_dir, af_data, tmp_path / "full")
    lora, lora_out = train_two_steps(af_dir, af_data, tmp_path / "lora", **{"models.student.lora.enable": True})
    far, far_out = train_two_steps(far_dir, far_data, tmp_path / "far")
    wan, wan_out = train_two_steps(tiny_model_of("wan21_t2v"), af_data, tmp_path / "wan", **{
        "models.student.lora.enable": True, "models.student.anyflow_from_wan": True})
    assert json.loads((wan_out / "scheduler" / "scheduler_config.json").read_text())["shift"] == 3.0  # the Wan repo's
    scheduler = json.loads((full_out / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMapEulerDiscreteScheduler" and scheduler["shift"] == 5.0
    assert json.loads((full_out / "model_index.json").read_text())["_class_name"] == "AnyFlowPipeline"
    assert json.loads((far_out / "model_index.json").read_text())["_class_name"] == "AnyFlowFARPipeline"
    assert not (lora_out / "model_index.json").exists()  # the LoRA loads over its base repo
    steps, size, frames = [1, 2, 4], 32, 17
    ours = {"full": validation_latents(full.config, full.method.student, steps, size, frames),
            "lora": validation_latents(lora.config, lora.method.student, steps, size, frames),
            "far": validation_latents(far.config, far.method.student, steps, size, frames),
            "wan": validation_latents(wan.config, wan.method.student, steps, size, frames)}
    jobs = {"full": [str(full_out), None], "lora": [str(af_dir), str(lora_out)], "base": [str(af_dir), None],
            "far": [str(far_out), None], "wan": [str(wan_out), str(wan_out)],
            "wan_base": [str(wan_out), None]}
    proc = subprocess.run(
        [sys.executable, "-c", STOCK_SAMPLER, json.dumps(jobs), json.dumps(steps), str(size), str(frames),
         str(TEXT_LENGTH), PROMPT],
        capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker, payload = proc.stdout.strip().splitlines()[-2:]
    assert marker == "FV_ACCEL_ABSENT"
    theirs = {k: torch.tensor(v) for k, v in json.loads(payload).items()}
    diffs = {}
    for name in ("full", "lora", "far", "wan"):
        for n in steps:
            stock = theirs[f"{name}/{n}"].reshape(ours[name][n].shape)
            diffs[f"{name}/{n}"] = float((stock - ours[name][n]).abs().max())
            assert diffs[f"{name}/{n}"] <= 1e-4, (name, n)
        assert float((ours[name][1] - ours[name][4]).abs().max()) > 1e-3  # the step count matters
    # The LoRAs were loaded (their samples are not their bases').
    assert float((theirs["lora/2"] - theirs["base/2"]).abs().max()) > 1e-3
    assert float((theirs["wan/2"] - theirs["wan_base/2"]).abs().max()) > 1e-3
    print(f"anyflow stock pipeline vs validation sampler, max |difference|: {diffs}")


# ---- AnyFlow-FAR ----


class PaddedKeysAttention:
    """FAR self-attention as AnyFlowFARPipeline's cache-read path computes it: the sequence padded with
    zero keys and values to a multiple of 128 and no mask, so the zero keys take part in the softmax."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 kv_cache=None, kv_cache_flag=None):
        from diffusers.models.transformers.transformer_anyflow_far import apply_rotary_emb

        parts = [attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(hidden_states)), attn.to_v(hidden_states)]
        q, k, v = (x.unflatten(2, (attn.heads, -1)).transpose(1, 2) for x in parts)
        q, k = apply_rotary_emb(q, rotary_emb["query"]), apply_rotary_emb(k, rotary_emb["key"])
        pad = -q.shape[2] % 128
        k, v = (torch.cat([x, x.new_zeros(*x.shape[:2], pad, x.shape[3])], dim=2) for x in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


def test_far_tiny_model_and_training_forward_against_the_far_pipelines_first_chunk(far_dir, tmp_path):
    """The tiny FAR repo loads in AnyFlowFARPipeline. Its first transformer call (chunk 0, the KV-cache
    read path, guidance on) gets training's inputs (latents, t, r, text, chunk_partition [1]); the
    outputs agree (1e-6) once training's self-attention also attends to the zero keys the pipeline's
    path pads to a multiple of 128 unmasked (PaddedKeysAttention), and differ without (diffusers'
    training path masks them: training keeps the mask). On the CPU the training path's dense block mask
    gives FlexAttention's values and a gradient."""
    from diffusers import AnyFlowFARPipeline
    from test_pipeline_consistency import loader_batches, record_pipeline

    from fv_accel.models.base import Conditioning, TrainingBatch

    pipe = AnyFlowFARPipeline.from_pretrained(str(far_dir))
    config = pipe.transformer.config
    assert (tuple(config.compressed_patch_size), config.full_chunk_limit, tuple(config.chunk_partition)) == ((1, 4, 4), 3, (1, 2, 2))
    assert json.loads((far_dir / "model_index.json").read_text())["_class_name"] == "AnyFlowFARPipeline"
    ((_, theirs, output),) = record_pipeline(
        pipe, {"transformer": pipe.transformer}, 1, prompt=PROMPT, height=32, width=32, num_frames=17,
        num_inference_steps=2, guidance_scale=2.0, max_sequence_length=TEXT_LENGTH,
    )
    assert theirs["chunk_partition"] == [1] and theirs["kv_cache"] is not None
    kept, dropped, _ = loader_batches(tmp_path, far_dir, text_max_length=TEXT_LENGTH)
    student = student_of(far_dir)
    assert type(student).__name__ == "AnyFlowFARStudent"
    x_t = theirs["hidden_states"][1:].permute(0, 2, 1, 3, 4)
    t, r = theirs["timestep"][1:, 0].float(), theirs["r_timestep"][1:, 0].float()
    masked = [block.attn1.processor for block in student.transformer.blocks]
    for row, batch in ((1, kept), (0, dropped)):
        cond = student.build_conditioning(batch)
        length = int(batch["text_attention_mask"].sum())
        torch.testing.assert_close(cond.text[:, :length], theirs["encoder_hidden_states"][row : row + 1, :length], rtol=0, atol=1e-6)
        assert not cond.text[:, length:].abs().sum() and not theirs["encoder_hidden_states"][row, length:].abs().sum()
        expected = output[row : row + 1].permute(0, 2, 1, 3, 4)
        seen: list = []
        hook = student.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(dict(k)), with_kwargs=True)
        with torch.no_grad():
            training = student.predict_velocity_with_r(x_t, t, r, TrainingBatch(conditioning=cond))
            for block in student.transformer.blocks:
                block.attn1.processor = PaddedKeysAttention()
            padded = student.predict_velocity_with_r(x_t, t, r, TrainingBatch(conditioning=cond))
        hook.remove()
        for block, processor in zip(student.transformer.blocks, masked):
            block.attn1.processor = processor
        assert seen[0]["chunk_partition"] == [1]
        for key in ("hidden_states", "timestep", "r_timestep"):
            assert float((seen[0][key].float() - theirs[key][row : row + 1].float()).abs().max()) <= 1e-6, key
        assert float((padded - expected).abs().max()) <= 1e-6
        assert float((training - expected).abs().max()) > 1e-3
    torch.manual_seed(4)
    x, tb = torch.randn(1, 16, 5, 4, 4), TrainingBatch(conditioning=Conditioning(text=torch.randn(1, 6, 32)))
    u = student.predict_velocity_with_r(x, torch.tensor([600.0]), torch.tensor([200.0]), tb)
    u.square().mean().backward()
    assert float(student.transformer.blocks[0].attn1.to_q.weight.grad.abs().sum()) > 0
    for block in student.transformer.blocks:
        block.attn1.processor = block.attn1.processor.flex_processor
    with torch.no_grad():
        flex = student.predict_velocity_with_r(x, torch.tensor([600.0]), torch.tensor([200.0]), tb)
    assert float((u - flex).abs().max()) <= 1e-5
    with pytest.raises(ValueError, match="returns the last full_chunk_limit"):
        student.predict_velocity_with_r(torch.randn(1, 16, 9, 4, 4), torch.tensor([600.0]), torch.tensor([200.0]), tb)


@pytest.mark.slow
def test_exports_of_a_student_made_from_wan_load_in_the_stock_pipeline(af_data, tiny_model_of, tmp_path):
    """A full run of a student made from the tiny Wan, checkpointed at its last step: `--to diffusers`
    of the checkpoint rebuilds the AnyFlow transformer (not the Wan base's class) with the run's
    weights; of the run folder, it writes a pipeline folder AnyFlowPipeline loads."""
    from diffusers import AnyFlowPipeline, AnyFlowTransformer3DModel

    from fv_accel.export import export

    _, out = train_two_steps(tiny_model_of("wan21_t2v"), af_data, tmp_path, **{
        "models.student.anyflow_from_wan": True, "models.student.r_embedder_gate_value": 0.5,
        "training.checkpoint.training_state_checkpointing_steps": 2})
    final = AnyFlowTransformer3DModel.from_pretrained(str(out / "transformer")).state_dict()
    (written,) = export(out / "checkpoint-2", "diffusers", tmp_path / "from_checkpoint")
    rebuilt = AnyFlowTransformer3DModel.from_pretrained(str(written))
    assert rebuilt.config.gate_value == 0.5
    assert all(torch.equal(v, final[k]) for k, v in rebuilt.state_dict().items())
    export(out, "diffusers", tmp_path / "from_run")
    pipe = AnyFlowPipeline.from_pretrained(str(tmp_path / "from_run"))
    assert pipe.scheduler.config.shift == 3.0 and pipe.transformer.config.gate_value == 0.5


def test_the_stock_pipeline_steps_the_flow_map_as_fastvideo_writes_it(af_dir, af_pipe):
    """AnyFlowPipeline at 3 steps equals the flow map written out over `predict_velocity_with_r`:
    t_i = 1000 * shift(1 - i / 3) (FastVideo's schedule, its final 0 the last r), r the next one,
    x_r = x_t - (t - r) / 1000 * u(x_t, t, r)."""
    from fv_accel.models.base import Conditioning, TrainingBatch

    student = student_of(af_dir)
    text = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(5))
    stock = af_pipe(prompt_embeds=text, height=32, width=32, num_frames=5, num_inference_steps=3, output_type="latent",
                    generator=torch.Generator().manual_seed(6)).frames
    x = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(6))
    shift = af_pipe.scheduler.config.shift
    sigmas = [shift * s / (1 + (shift - 1) * s) for s in (1.0, 2 / 3, 1 / 3, 0.0)]
    tb = TrainingBatch(conditioning=Conditioning(text=text))
    with torch.no_grad():
        for t, r in zip(sigmas[:-1], sigmas[1:]):
            u = student.predict_velocity_with_r(x, torch.tensor([1000 * t]), torch.tensor([1000 * r]), tb)
            x = x - (t - r) * u
    assert float((stock - x).abs().max()) <= 1e-5
