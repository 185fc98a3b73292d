"""Block-causal students: frame rules, backends, causality, teacher forcing, KV-cached rollout."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from fv_accel.config import ConfigError, load_config
from fv_accel.models import WanStudent
from fv_accel.models.attention import (
    CausalAttention,
    CausalSpec,
    KVCache,
    TokenLayout,
    block_mask_nbytes,
    build_block_mask,
    dense_token_mask,
    sequence_visibility,
    teacher_forcing_visibility,
)
from fv_accel.models.base import TrainingBatch
from fv_accel.rollout import causal_reference_sampler, kv_cached_rollout

from conftest import REPO, tiny_overrides

CAUSAL_RECIPE = REPO / "configs" / "tiny_dfsft_causal.yaml"
TFSFT_RECIPE = REPO / "configs" / "tiny_tfsft.yaml"
T, H, W = 6, 6, 6  # tiny latent grid: 6 frames of 3x3 tokens


def make_student(chunk=2, causal=True, seed=0, **overrides) -> WanStudent:
    cfg = load_config(
        CAUSAL_RECIPE, {"method.chunk_size": chunk, "models.student.causal": causal, **overrides}
    )
    torch.manual_seed(seed)
    student = WanStudent(cfg)
    student.init_preprocessors(cfg.training)
    return student


def inputs(seed=0, b=1, frames=T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 16, frames, H, W, generator=g)
    t = torch.rand(b, frames, generator=g) * 1000
    text = torch.randn(b, 16, 32, generator=g)  # short prompts keep the tiny model fast
    return x, t, TrainingBatch(encoder_hidden_states=text)


# ---- frame rules ----


def test_frame_rules_block_causal_window_sink_and_teacher_forcing():
    assert sequence_visibility(CausalSpec(2), 5).int().tolist() == [
        [1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]
    # Window of 4 frames from the block's end, frame 0 a sink.
    assert sequence_visibility(CausalSpec(2, local_attn_size=4, sink_size=1), 7).int().tolist() == [
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 0, 1, 1, 1, 1, 0],
        [1, 0, 1, 1, 1, 1, 0],
        [1, 0, 0, 1, 1, 1, 1],
    ]
    # [clean 0..3 | noisy 0..3], blocks of 2: noisy block 1 sees clean block 0 and itself.
    assert teacher_forcing_visibility(CausalSpec(2), 4).int().tolist() == [
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1],
        [1, 1, 0, 0, 0, 0, 1, 1],
    ]


def test_bad_window_and_backend_are_clear_errors():
    with pytest.raises(ValueError, match="local_attn_size"):
        CausalSpec(3, local_attn_size=2)
    with pytest.raises(ValueError, match="causal_attention_backend"):
        CausalAttention(CausalSpec(3), backend="xformers")
    with pytest.raises(ConfigError, match="models.student.local_attn_size"):
        load_config(CAUSAL_RECIPE, {"models.student.local_attn_size": 0})
    with pytest.raises(ConfigError, match="models.student.sink_size"):
        load_config(CAUSAL_RECIPE, {"models.student.sink_size": -1})


# ---- backends against the dense boolean-mask reference ----


@pytest.mark.parametrize("layout,frames", [("sequence", 7), ("teacher_forcing", 10)])
@pytest.mark.parametrize("spec", [CausalSpec(3), CausalSpec(2, local_attn_size=4, sink_size=1), CausalSpec(1)])
def test_attention_backends_match_dense_reference(layout, frames, spec):
    # 37 tokens per frame: FlexAttention tiles (128 tokens) straddle frames, so partial tiles occur.
    s = 37
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, frames * s, 8, generator=g, dtype=torch.float64) for _ in range(3))
    tl = TokenLayout(layout, frames, s)
    ref = CausalAttention(spec, "dense").attend(q, k, v, tl, 0)
    chunked = CausalAttention(spec, "chunked").attend(q, k, v, tl, 0)
    flex = CausalAttention(spec, "flex").attend(q, k, v, tl, 0)
    assert (chunked - ref).abs().max() < 1e-12
    assert (flex - ref).abs().max() < 1e-12


def test_block_mask_tiles_match_dense_mask_exactly():
    spec = CausalSpec(2, local_attn_size=4, sink_size=1)
    s, tile = 60, 128
    vis = teacher_forcing_visibility(spec, 7)
    bm = build_block_mask(vis, s, "cpu", tile=tile)
    dense = dense_token_mask(vis, s)
    n_q, n_k = math.ceil(dense.shape[0] / tile), math.ceil(dense.shape[1] / tile)
    padded = torch.zeros(n_q * tile, n_k * tile, dtype=torch.bool)
    padded[: dense.shape[0], : dense.shape[1]] = dense
    valid = torch.zeros_like(padded)
    valid[: dense.shape[0], : dense.shape[1]] = True
    tiles = padded.view(n_q, tile, n_k, tile).sum((1, 3))
    valid_tiles = valid.view(n_q, tile, n_k, tile).sum((1, 3))
    want_full = tiles == valid_tiles
    want_partial = (tiles > 0) & ~want_full

    def as_dense(num, idx):
        out = torch.zeros(n_q, n_k, dtype=torch.bool)
        for row in range(n_q):
            out[row, idx[0, 0, row, : num[0, 0, row]].long()] = True
        return out

    assert torch.equal(as_dense(bm.full_kv_num_blocks, bm.full_kv_indices), want_full)
    assert torch.equal(as_dense(bm.kv_num_blocks, bm.kv_indices), want_partial)


def test_block_mask_memory_for_21_frames_at_480x832_is_small_and_cached():
    # 480x832 video -> latent 60x104 -> 30x52 tokens per frame; 21 latent frames; chunks of 3.
    attn = CausalAttention(CausalSpec(3), "flex")
    mask = attn.block_mask("sequence", 21, 30 * 52, "cpu")
    nbytes = block_mask_nbytes(mask)
    dense_bytes = (21 * 30 * 52) ** 2  # a bool [L, L] mask
    print(f"block mask {nbytes / 1e6:.2f} MB vs dense boolean mask {dense_bytes / 1e6:.0f} MB")
    assert nbytes < 10 * 2**20
    assert dense_bytes > 1000 * nbytes
    assert attn.block_mask("sequence", 21, 30 * 52, "cpu") is mask  # built once per shape


# ---- the tiny model ----


@pytest.mark.parametrize("chunk", [2, 1])
def test_causal_student_outputs_of_earlier_chunks_ignore_later_frames(chunk):
    student = make_student(chunk=chunk)
    x, t, tb = inputs()
    with torch.no_grad():
        base = student.predict_noise(x, t, tb)
        for k in range(T // chunk - 1):
            end = (k + 1) * chunk
            changed = x.clone()
            changed[:, :, end:] += torch.randn_like(changed[:, :, end:])
            t_changed = t.clone()
            t_changed[:, end:] = 500.0
            out = student.predict_noise(changed, t_changed, tb)
            assert torch.equal(out[:, :, :end], base[:, :, :end]), f"chunk <= {k} saw a later frame"
            assert (out[:, :, end:] - base[:, :, end:]).abs().max() > 1e-3
        if chunk > 1:
            # Inside a chunk frames see each other: the last frame of chunk 0 moves frame 0.
            changed = x.clone()
            changed[:, :, chunk - 1] += 1.0
            out = student.predict_noise(changed, t, tb)
            assert (out[:, :, 0] - base[:, :, 0]).abs().max() > 1e-3


def test_bidirectional_student_is_not_causal():
    # The check above can fail: a bidirectional student's frame 0 depends on frame 5.
    student = make_student(chunk=2, causal=False)
    x, t, tb = inputs()
    with torch.no_grad():
        base = student.predict_noise(x, t, tb)
        changed = x.clone()
        changed[:, :, -1] += 1.0
        assert (student.predict_noise(changed, t, tb)[:, :, 0] - base[:, :, 0]).abs().max() > 1e-3


def _forward_and_grads(student, x, t, tb, weight):
    student.transformer.zero_grad(set_to_none=True)
    out = student.predict_noise(x, t, tb)
    (out * weight).sum().backward()
    grads = {n: p.grad.clone() for n, p in student.transformer.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("overrides", [{}, {"models.student.local_attn_size": 4, "models.student.sink_size": 1}])
def test_chunked_equals_dense_reference_forward_and_gradients(overrides):
    student = make_student(chunk=2, **overrides)
    x, t, tb = inputs()
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    student.causal_attention.backend = "chunked"
    out_c, grads_c = _forward_and_grads(student, x, t, tb, weight)
    student.causal_attention.backend = "dense"
    out_d, grads_d = _forward_and_grads(student, x, t, tb, weight)
    assert (out_c - out_d).abs().max() < 1e-5
    assert grads_c.keys() == grads_d.keys() and len(grads_c) > 10
    for name in grads_c:
        # fp32 gradients reach ~30 here: 1e-5 on the scale of each parameter's gradient (>= 1).
        scale = max(1.0, float(grads_d[name].abs().max()))
        assert (grads_c[name] - grads_d[name]).abs().max() < 1e-5 * scale, name


def test_flex_equals_dense_reference_forward_on_cpu():
    student = make_student(chunk=2)
    x, t, tb = inputs()
    with torch.no_grad():
        student.causal_attention.backend = "dense"
        ref = student.predict_noise(x, t, tb)
        student.causal_attention.backend = "flex"
        out = student.predict_noise(x, t, tb)
        context = torch.randn_like(x)
        ref_tf = None
        for backend in ("dense", "flex"):
            student.causal_attention.backend = backend
            pair = student.predict_noise_teacher_forcing(context, torch.zeros_like(t), x, t, tb)
            if ref_tf is None:
                ref_tf = pair
            else:
                assert all((a - b).abs().max() < 1e-5 for a, b in zip(pair, ref_tf))
    assert (out - ref).abs().max() < 1e-5


def test_skyreels_student_is_block_causal_without_its_dense_mask():
    student = make_student(
        chunk=2, **{"models.student.model_class": "skyreels_v2", "models.student.transformer_config.num_frame_per_block": 2}
    )
    assert student.kind == "skyreels_v2"
    assert student.transformer.config.num_frame_per_block == 1  # its dense [L, L] mask is never built
    x, t, tb = inputs()
    with torch.no_grad():
        base = student.predict_noise(x, t, tb)
        changed = x.clone()
        changed[:, :, 4:] += 1.0
        out = student.predict_noise(changed, t, tb)
        inside = x.clone()
        inside[:, :, 3] += 1.0
        out_inside = student.predict_noise(inside, t, tb)
    assert torch.equal(out[:, :, :4], base[:, :, :4])
    assert (out[:, :, 4] - base[:, :, 4]).abs().max() > 1e-3
    assert (out_inside[:, :, 2] - base[:, :, 2]).abs().max() > 1e-3  # frame 3 is in frame 2's chunk


# ---- teacher forcing ----


def test_teacher_forcing_isolation_and_positions():
    student = make_student(chunk=2)
    x, t, tb = inputs()
    context = torch.randn_like(x)
    ct = torch.zeros_like(t)
    with torch.no_grad():
        clean_out, noisy_out = student.predict_noise_teacher_forcing(context, ct, x, t, tb)
        for b in range(3):
            s, e = 2 * b, 2 * b + 2
            changed = x + torch.randn_like(x)
            changed[:, :, s:e] = x[:, :, s:e]  # every other block's noisy tokens change
            clean2, noisy2 = student.predict_noise_teacher_forcing(context, ct, changed, t, tb)
            assert torch.equal(noisy2[:, :, s:e], noisy_out[:, :, s:e]), f"noisy block {b} saw other noisy blocks"
            # The clean half never sees the noisy half.
            assert torch.equal(clean2, clean_out)
            # Noisy block b = the causal model on [clean blocks < b | noisy block b] (same positions).
            seq = student.predict_noise(
                torch.cat([context[:, :, :s], x[:, :, s:e]], 2), torch.cat([ct[:, :s], t[:, s:e]], 1), tb
            )
            assert (seq[:, :, s:e] - noisy_out[:, :, s:e]).abs().max() < 1e-5
        # The noisy half does see the clean copies of earlier blocks.
        _, noisy3 = student.predict_noise_teacher_forcing(context + 1.0, ct, x, t, tb)
        assert torch.equal(noisy3[:, :, :2], noisy_out[:, :, :2])
        assert (noisy3[:, :, 2:] - noisy_out[:, :, 2:]).abs().max() > 1e-3


def test_teacher_forcing_layout_survives_gradient_checkpointing():
    x, t, tb = inputs()
    context = torch.randn_like(x)
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    grads = []
    for ckpt in (None, "full"):
        student = make_student(chunk=2, **{"training.model.enable_gradient_checkpointing_type": ckpt})
        student.transformer.train()
        _, noisy = student.predict_noise_teacher_forcing(context, torch.zeros_like(t), x, t, tb)
        (noisy * weight).sum().backward()
        grads.append({n: p.grad.clone() for n, p in student.transformer.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert (grads[0][name] - grads[1][name]).abs().max() < 1e-5, name


def _method(recipe, **overrides):
    from fv_accel.methods import METHODS

    cfg = load_config(recipe, overrides)
    torch.manual_seed(0)
    student = WanStudent(cfg)
    return METHODS[cfg.method.name](cfg=cfg, role_models={"student": student})


def _batch(b=2, seed=0):
    x, _, tb = inputs(seed, b=b)
    return {
        "vae_latent": x,
        "text_embedding": tb.encoder_hidden_states,
        "sample_index": torch.arange(b),
        "epoch": torch.zeros(b, dtype=torch.long),
    }


def test_tfsft_loss_is_the_noisy_half_of_a_teacher_forcing_forward():
    method = _method(TFSFT_RECIPE, **{"method.chunk_size": 2})
    batch = _batch()
    loss_map, outputs, _ = method.single_train_step(batch, 0)
    tb = outputs["training_batch"]
    with torch.no_grad():
        _, noisy = method.student.predict_noise_teacher_forcing(
            tb.latents, torch.zeros_like(tb.timesteps), tb.noisy_model_input, tb.timesteps, tb
        )
        expected = method.compute_loss(noisy, tb)
    assert set(loss_map) == {"total_loss", "tfsft_loss"}
    assert torch.isfinite(loss_map["total_loss"])
    assert abs(float(loss_map["total_loss"].detach()) - float(expected)) < 1e-6
    # Timesteps are per chunk of 2 (DFSFT's draws).
    assert torch.equal(tb.timesteps[:, ::2], tb.timesteps[:, 1::2])


def test_tfsft_needs_a_causal_student_and_a_valid_context_timestep():
    with pytest.raises(ValueError, match="models.student.causal"):
        _method(TFSFT_RECIPE, **{"models.student.causal": False})
    with pytest.raises(ValueError, match="method.context_timestep"):
        _method(TFSFT_RECIPE, **{"method.context_timestep": 1000.0})


def test_dfsft_guard_block_size_and_bidirectional_notice(caplog):
    from fv_accel.methods import DiffusionForcingSFTMethod

    cfg = load_config(CAUSAL_RECIPE, {"method.chunk_size": 3})
    student = WanStudent(cfg)  # block size 3
    other = load_config(CAUSAL_RECIPE, {"method.chunk_size": 2})
    with pytest.raises(ValueError, match=r"chunk_size \(2\) must equal the student's causal block size \(3\)"):
        DiffusionForcingSFTMethod(cfg=other, role_models={"student": student})

    notice = "trains a bidirectional model"
    with caplog.at_level(logging.WARNING, logger="fv_accel.methods.fine_tuning.dfsft"):
        _method(CAUSAL_RECIPE, **{"models.student.causal": False})
    assert sum(notice in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fv_accel.methods.fine_tuning.dfsft"):
        _method(CAUSAL_RECIPE)
    assert not any(notice in r.getMessage() for r in caplog.records)


# ---- KV-cached rollout ----


@pytest.mark.parametrize(
    "chunk,guidance,overrides",
    [
        (2, 1.0, {}),
        (3, 4.0, {}),
        (1, 1.0, {"models.student.local_attn_size": 2, "models.student.sink_size": 1}),
    ],
)
def test_kv_cached_rollout_equals_uncached_causal_sampler(chunk, guidance, overrides):
    student = make_student(chunk=chunk, **overrides)
    noise, _, tb = inputs(seed=1)
    negative = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(9))
    kwargs = dict(num_steps=3, shift=3.0, guidance_scale=guidance, negative_text=negative if guidance > 1 else None)
    cached = kv_cached_rollout(student, noise, tb.encoder_hidden_states, **kwargs)
    reference = causal_reference_sampler(student, noise, tb.encoder_hidden_states, **kwargs)
    assert cached.latents.shape == noise.shape
    assert (cached.latents - reference.latents).abs().max() < 1e-4
    assert (cached.latents - noise).abs().max() > 0.1  # it did denoise
    # Less work: only the current chunk runs each step (plus one refresh per finished chunk).
    assert cached.forward_frames < reference.forward_frames


def test_kv_cached_rollout_with_noisy_context_and_a_generator():
    # The context noise is one [B, C, T, H, W] draw up front in both samplers.
    student = make_student(chunk=2)
    noise, _, tb = inputs(seed=2)
    kwargs = dict(num_steps=3, shift=3.0, context_noise=0.05)
    cached = kv_cached_rollout(student, noise, tb.encoder_hidden_states, generator=torch.Generator().manual_seed(7), **kwargs)
    reference = causal_reference_sampler(
        student, noise, tb.encoder_hidden_states, generator=torch.Generator().manual_seed(7), **kwargs
    )
    assert (cached.latents - reference.latents).abs().max() < 1e-4


def test_windowed_kv_cache_drops_frames_no_later_chunk_can_see():
    student = make_student(chunk=1, **{"models.student.local_attn_size": 2, "models.student.sink_size": 1})
    x, _, tb = inputs(frames=6)
    cache = KVCache()
    attn = student.causal_attention
    with torch.no_grad():
        for f in range(5):
            with attn.kv_cache(cache, f, write=True):
                student.predict_noise(x[:, :, f : f + 1], torch.zeros(1, 1), tb)
    # After frame 4: later frames see the sink (0) and frames >= 4 (window 2 from frame 5's end 6).
    assert [start for start, _, _ in cache.segments[0]] == [0, 4]


# ---- tiny runs: train, then sample ----


@pytest.mark.parametrize(
    "recipe,chunk", [(CAUSAL_RECIPE, 3), (CAUSAL_RECIPE, 1), (TFSFT_RECIPE, 3)], ids=["causal-chunk3", "causal-framewise", "tfsft"]
)
def test_tiny_causal_runs_train_and_sample(tmp_path, tiny_data_path, recipe, chunk):
    from fv_accel.build import build_from_config
    from fv_accel.trainer import Trainer

    overrides = tiny_overrides(
        tmp_path,
        **{
            "method.chunk_size": chunk,
            "training.loop.max_train_steps": 3,
            "training.data.data_path": tiny_data_path,
            "training.checkpoint.save_final": False,
        },
    )
    run = build_from_config(recipe, overrides)
    student = run.method.student
    assert student.causal_block_size == chunk
    Trainer(run).run()
    losses = [json_line["loss"] for json_line in _metrics(tmp_path)]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    noise, _, tb = inputs(seed=3)
    kwargs = dict(num_steps=3, shift=3.0, guidance_scale=2.0, negative_text=torch.zeros_like(tb.encoder_hidden_states))
    cached = kv_cached_rollout(student, noise, tb.encoder_hidden_states, **kwargs)
    reference = causal_reference_sampler(student, noise, tb.encoder_hidden_states, **kwargs)
    assert torch.isfinite(cached.latents).all()
    assert (cached.latents - reference.latents).abs().max() < 1e-4


def _metrics(tmp_path):
    import json

    path = tmp_path / "out" / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_saved_causal_student_is_marked_and_reloading_without_causal_warns(tmp_path, tiny_data_path, caplog):
    """The saved transformer loads in plain diffusers unchanged (the record is a private config key),
    and fv_accel warns when a recipe would load those weights with full attention."""
    import json

    from diffusers import WanTransformer3DModel

    from fv_accel.build import build_from_config
    from fv_accel.export import export
    from fv_accel.models.attention import SAVED_ATTENTION_KEY
    from fv_accel.trainer import Trainer

    overrides = tiny_overrides(
        tmp_path,
        **{
            "method.chunk_size": 2,
            "models.student.local_attn_size": 4,
            "models.student.sink_size": 1,
            "training.loop.max_train_steps": 2,
            "training.data.data_path": tiny_data_path,
            "training.checkpoint.training_state_checkpointing_steps": 1,
            "training.checkpoint.save_final": True,
        },
    )
    Trainer(build_from_config(CAUSAL_RECIPE, overrides)).run()
    out = tmp_path / "out"
    record = json.loads((out / "transformer" / "config.json").read_text())[SAVED_ATTENTION_KEY]
    assert (record["causal"], record["block_size"], record["local_attn_size"], record["sink_size"]) == (True, 2, 4, 1)

    with caplog.at_level(logging.INFO):
        plain = WanTransformer3DModel.from_pretrained(out, subfolder="transformer")
    # diffusers keeps the private key in the config, uses it for nothing and says nothing about it.
    assert plain.config[SAVED_ATTENTION_KEY] == record
    assert not any(SAVED_ATTENTION_KEY in r.getMessage() for r in caplog.records)

    # Exported from the checkpoint of step 1: the same record, from the checkpoint's run config.
    exported = export(out / "checkpoint-1", "diffusers", tmp_path / "export")[0]
    assert json.loads((exported / "config.json").read_text())[SAVED_ATTENTION_KEY] == record

    def load(**extra):
        cfg = load_config(
            CAUSAL_RECIPE,
            {"models.student.init_from": str(out), "models.student.transformer_config": None, **extra},
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fv_accel.models.wan"):
            WanStudent(cfg)
        return [r.getMessage() for r in caplog.records]

    # Fine-tuned on bidirectionally, the weights are saved without the causal record.
    bidir = tmp_path / "bidir"
    Trainer(build_from_config(CAUSAL_RECIPE, {
        **overrides,
        "training.checkpoint.output_dir": str(bidir),
        "training.checkpoint.training_state_checkpointing_steps": 0,
        "training.loop.max_train_steps": 1,
        "models.student.causal": False,
        "models.student.init_from": str(out),
        "models.student.transformer_config": None,
    })).run()
    assert SAVED_ATTENTION_KEY not in json.loads((bidir / "transformer" / "config.json").read_text())

    full = load(**{"models.student.causal": False})
    assert len(full) == 1 and "loaded here with full attention" in full[0] and "method.chunk_size: 2" in full[0]
    other = load(**{"method.chunk_size": 3})
    assert len(other) == 1 and "this run uses block size 3, local_attn_size -1, sink_size 0" in other[0]
    assert load(**{"method.chunk_size": 2, "models.student.local_attn_size": 4, "models.student.sink_size": 1}) == []


def test_a_bidirectional_student_saves_no_attention_record(tmp_path, tiny_data_path):
    import json

    from fv_accel.build import build_from_config
    from fv_accel.models.attention import SAVED_ATTENTION_KEY
    from fv_accel.trainer import Trainer

    overrides = tiny_overrides(
        tmp_path,
        **{
            "models.student.causal": False,
            "training.loop.max_train_steps": 1,
            "training.data.data_path": tiny_data_path,
            "training.checkpoint.save_final": True,
        },
    )
    Trainer(build_from_config(CAUSAL_RECIPE, overrides)).run()
    config = json.loads((tmp_path / "out" / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel" and SAVED_ATTENTION_KEY not in config


# ---- causal leaks: a later chunk changes no earlier output, in every layout ----


def _ti2v_i2v_method(tiny_variant_dir, recipe: str = "dfsft", **overrides):
    from fv_accel.config import default_recipe
    from fv_accel.methods import METHODS
    from fv_accel.models import build_student

    over = {
        "models.student.init_from": str(tiny_variant_dir("wan22_ti2v")), "models.student.task": "i2v",
        "models.student.causal": True, "method.chunk_size": 2, "callbacks.validation.enable": False, **overrides,
    }
    cfg = load_config(default_recipe("dfsft") if recipe == "dfsft" else recipe, over)
    torch.manual_seed(0)
    student = build_student(cfg)
    return student, METHODS[cfg.method.name](cfg=cfg, role_models={"student": student})


def _ti2v_batch() -> dict:
    g = torch.Generator().manual_seed(4)
    return {
        "vae_latent": torch.randn(1, 48, 5, 4, 4, generator=g),  # 5 latent frames: the image, then 2 chunks of 2
        "text_embedding": torch.randn(1, 6, 32, generator=g),
        "sample_index": torch.tensor([0]),
        "epoch": torch.tensor([0]),
    }


def test_ti2v_image_to_video_noise_chunks_are_the_attention_blocks_after_the_clean_frame(tiny_variant_dir):
    student, method = _ti2v_i2v_method(tiny_variant_dir)
    assert student.causal_spec().prefix_frames == 1
    tb = method._prepare(_ti2v_batch())
    idx = tb.timestep_indices[0].tolist()
    assert idx[0] == -1 and idx[1] == idx[2] and idx[3] == idx[4] and idx[2] != idx[3]  # [clean | chunk | chunk]
    x, t = tb.noisy_model_input, tb.timesteps
    with torch.no_grad():
        base = student.predict_noise(x, t, tb)
        for end in (1, 3):  # the end of the condition frame's block, of the first noise chunk's
            moved = x.clone()
            moved[:, :, end:] += torch.randn_like(moved[:, :, end:])
            t_moved = t.clone()
            t_moved[:, end:] = 500.0
            out = student.predict_noise(moved, t_moved, tb)
            assert torch.equal(out[:, :, :end], base[:, :, :end]), f"frames < {end} saw a later chunk"
            assert (out[:, :, end:] - base[:, :, end:]).abs().max() > 1e-3
        # Inside a noise chunk the frames see each other, and every chunk sees the condition frame.
        inside = x.clone()
        inside[:, :, 2] += 1.0
        assert (student.predict_noise(inside, t, tb)[:, :, 1] - base[:, :, 1]).abs().max() > 1e-3
        image = x.clone()
        image[:, :, 0] += 1.0
        assert (student.predict_noise(image, t, tb)[:, :, 3] - base[:, :, 3]).abs().max() > 1e-3


def test_ti2v_image_to_video_teacher_forcing_sees_no_later_chunk(tiny_variant_dir):
    student, method = _ti2v_i2v_method(tiny_variant_dir, TFSFT_RECIPE)
    tb = method._prepare(_ti2v_batch())
    context, x, t = tb.latents, tb.noisy_model_input, tb.timesteps
    ct = torch.zeros_like(t)
    with torch.no_grad():
        _, base = student.predict_noise_teacher_forcing(context, ct, x, t, tb)
        for end in (1, 3):
            moved, moved_context = x.clone(), context.clone()
            moved[:, :, end:] += 1.0
            moved_context[:, :, end:] += 1.0
            _, out = student.predict_noise_teacher_forcing(moved_context, ct, moved, t, tb)
            assert torch.equal(out[:, :, :end], base[:, :, :end]), f"noisy frames < {end} saw a later chunk"
            assert (out[:, :, end:] - base[:, :, end:]).abs().max() > 1e-3


def test_kv_cached_rollout_of_a_later_chunk_changes_no_earlier_chunk():
    student = make_student(chunk=2)
    noise, _, tb = inputs(seed=3)
    kwargs = dict(num_steps=1, shift=3.0)
    base = kv_cached_rollout(student, noise, tb.encoder_hidden_states, **kwargs).latents
    moved = noise.clone()
    moved[:, :, 4:] += 1.0  # the last chunk's noise
    out = kv_cached_rollout(student, moved, tb.encoder_hidden_states, **kwargs).latents
    assert torch.equal(out[:, :, :4], base[:, :, :4])
    assert (out[:, :, 4:] - base[:, :, 4:]).abs().max() > 1e-3


def test_ltx_condition_pipeline_student_is_block_causal_on_its_coordinates(tiny_model_of):
    from fv_accel.config import default_recipe
    from fv_accel.models import build_student
    from fv_accel.models.base import Conditioning

    over = {
        "models.student.init_from": str(tiny_model_of("ltx_video_condition")), "models.student.causal": True,
        "method.chunk_size": 2, "callbacks.validation.enable": False,
    }
    torch.manual_seed(0)
    student = build_student(load_config(default_recipe("dfsft"), over))
    assert student.pipeline == "LTXConditionPipeline"
    g = torch.Generator().manual_seed(5)
    x, text = torch.randn(1, 16, 4, 2, 2, generator=g), torch.randn(1, 6, 32, generator=g)
    cond = Conditioning(text=text, text_mask=torch.ones(1, 6, dtype=torch.long))
    t = torch.tensor([[300.0, 300.0, 700.0, 700.0]])
    attn = student.causal_attention
    with torch.no_grad():
        base = student.forward(x, t, cond)
        moved = x.clone()
        moved[:, :, 2:] += 1.0
        out = student.forward(moved, t, cond)
        assert torch.equal(out[:, :, :2], base[:, :, :2])
        assert (out[:, :, 2:] - base[:, :, 2:]).abs().max() > 1e-3
        # The cached block at frames 2-3 has the coordinates of frames 2-3 (LTXConditionPipeline's).
        cache = KVCache()
        with attn.kv_cache(cache, 0, write=True):
            student.forward(x[:, :, :2], t[:, :2], cond)
        with attn.kv_cache(cache, 2):
            cached = student.forward(x[:, :, 2:], t[:, 2:], cond)
    assert (cached - base[:, :, 2:]).abs().max() < 1e-5
