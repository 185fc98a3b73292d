"""Video sparse attention (fv_accel.vsa): the math against an independent float64 implementation,
every CPU backend, and `enable_vsa` on the tiny Wan-family transformers (gates in the state dict,
FastWan checkpoints, run-time sparsity, gradients)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fv_accel import vsa
from fv_accel.models.wan import SKYREELS_FPS_INDEX
from fv_accel.vsa import enable_vsa, load_vsa_gates, video_sparse_attention

CPU_BACKENDS = ("reference", "gathered", "flex")
DIVISIBLE, RAGGED = (4, 4, 8), (5, 6, 7)  # the second has edge tiles of 1, 2 and 3 tokens


def loop_vsa(q, k, v, grid, sparsity, gate=None):
    """VSA written plainly in float64, one (batch, head, query tile) at a time (the semantics of
    FastVideo's video_sparse_attn, independent of fv_accel.vsa)."""
    q, k, v = (x.double() for x in (q, k, v))
    batch, tokens, heads, dim = q.shape
    t_len, h_len, w_len = grid
    tiles = []  # raster token indices of each tile, tiles ordered t, h, w
    for t0 in range(0, t_len, 4):
        for h0 in range(0, h_len, 4):
            for w0 in range(0, w_len, 4):
                tiles.append(torch.tensor([
                    (t * h_len + h) * w_len + w
                    for t in range(t0, min(t0 + 4, t_len))
                    for h in range(h0, min(h0 + 4, h_len))
                    for w in range(w0, min(w0 + 4, w_len))
                ]))
    keep = max(1, min(math.ceil((1 - sparsity) * len(tiles)), len(tiles)))
    out = torch.zeros(batch, tokens, heads, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            means = [torch.stack([x[b, tile, h].mean(0) for tile in tiles]) for x in (q, k, v)]
            scores = means[0] @ means[1].T / math.sqrt(dim)
            coarse = torch.softmax(scores, -1) @ means[2]
            for i, tile in enumerate(tiles):
                keys = torch.cat([tiles[j] for j in torch.topk(scores[i], keep).indices.tolist()])
                weights = torch.softmax(q[b, tile, h] @ k[b, keys, h].T / math.sqrt(dim), -1)
                weight = 1.0 if gate is None else gate[b, tile, h].double()
                out[b, tile, h] = weights @ v[b, keys, h] + coarse[i] * weight
    return out


def qkvg(grid, batch=2, heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = math.prod(grid)
    return [torch.randn(batch, tokens, heads, dim, generator=g) for _ in range(4)]


@pytest.mark.parametrize("grid", [DIVISIBLE, RAGGED], ids=["divisible", "ragged"])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.8])
def test_every_cpu_backend_matches_the_float64_loop(grid, sparsity):
    q, k, v, gate = qkvg(grid)
    expected = loop_vsa(q, k, v, grid, sparsity, gate)
    backends = CPU_BACKENDS if sparsity > 0 or grid == RAGGED else ("reference", "gathered")
    for backend in backends:
        out = video_sparse_attention(q, k, v, grid=grid, sparsity=sparsity, gate=gate, backend=backend)
        assert out.shape == q.shape and out.dtype == q.dtype
        err = (out.double() - expected).abs().max().item()
        assert err < 1e-4, f"{backend}: max error {err:.2e}"
    # Without a gate the coarse branch is added with weight 1, as the kernel does.
    out = video_sparse_attention(q, k, v, grid=grid, sparsity=sparsity, backend="gathered")
    assert (out.double() - loop_vsa(q, k, v, grid, sparsity)).abs().max().item() < 1e-4


def test_sparsity_zero_with_a_zero_gate_is_dense_attention():
    q, k, v, _ = qkvg(RAGGED)
    dense = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    for backend in CPU_BACKENDS:
        out = video_sparse_attention(q, k, v, grid=RAGGED, sparsity=0.0, gate=torch.zeros_like(q), backend=backend)
        assert (out - dense).abs().max().item() < 1e-5, backend


def test_selection_count_and_the_tile_layout():
    assert [vsa.topk_tiles(s, 10) for s in (0.0, 0.5, 0.7, 0.8, 0.9, 1.0)] == [10, 5, 4, 2, 1, 1]  # 0.7: float ceil, as FastVideo
    layout = vsa.tile_layout(RAGGED)
    assert layout.tiles == (2, 2, 2) and layout.sizes.tolist() == [64, 48, 32, 24, 16, 12, 8, 6]
    # Valid tokens first in each tile's 64 slots (the kernel masks slots >= the tile's size); the
    # ragged grids of the loop comparison above show that the padding is never attended.
    assert sorted(layout.slot.tolist()) == [i for i in range(8 * 64) if i % 64 < layout.sizes[i // 64]]
    # Inside a tile the tokens keep raster order: tile 1 (t 0-3, h 0-3, w 4-6) holds (0, 0, 4),
    # (0, 0, 5), (0, 0, 6), (0, 1, 4), ...
    assert layout.token_of_slot[64:68].tolist() == [4, 5, 6, 11]


def test_the_compiled_flex_block_mask_visits_exactly_the_selected_tiles():
    """On CUDA FlexAttention runs compiled and visits only the blocks of its BlockMask; its
    mask_mod then hides padding only, one function per grid (no recompilation per call)."""
    layout = vsa.tile_layout(RAGGED)
    idx = torch.topk(torch.randn(2, 3, layout.num_tiles, layout.num_tiles, generator=torch.Generator().manual_seed(0)), 3, -1).indices
    mask = vsa.selection_block_mask(idx, layout, compiled=True)
    keep = torch.zeros(2, 3, 8, 8, dtype=torch.bool).scatter_(-1, idx, True)
    assert torch.equal(mask.to_dense().bool(), keep)
    assert torch.equal(mask.full_kv_num_blocks, (keep & layout.full).sum(-1).int())  # edge tiles are partial
    assert mask.mask_mod is vsa.selection_block_mask(idx.flip(-1), layout, compiled=True).mask_mod


@pytest.mark.parametrize("chunk_elements", [None, 20_000], ids=["one_chunk", "chunks"])
def test_gathered_gradients_match_the_reference(monkeypatch, chunk_elements):
    if chunk_elements:  # several chunks of query tiles, each gathered again in the backward
        monkeypatch.setattr(vsa, "GATHER_CHUNK_ELEMENTS", chunk_elements)
    q, k, v, gate = qkvg(RAGGED, seed=1)
    grads = {}
    for backend in ("reference", "gathered"):
        inputs = [x.clone().requires_grad_(True) for x in (q, k, v, gate)]
        out = video_sparse_attention(*inputs[:3], grid=RAGGED, sparsity=0.5, gate=inputs[3], backend=backend)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[backend] = [x.grad for x in inputs]
    for name, a, b in zip("qkvg", grads["reference"], grads["gathered"]):
        assert a.abs().sum() > 0, f"no gradient to {name}"
        assert (a - b).abs().max().item() < 1e-5, name


def test_bad_inputs_and_backends_fail_in_one_line():
    q, k, v, _ = qkvg(DIVISIBLE)
    assert vsa.resolve_backend("auto", q) == "gathered"
    cases = [
        (dict(grid=DIVISIBLE, sparsity=1.5), "sparsity must be a number in [0, 1]"),
        (dict(grid=(4, 4), sparsity=0.5), "grid must be three positive integers"),
        (dict(grid=(4, 4, 4), sparsity=0.5), "do not fill the grid"),
        (dict(grid=DIVISIBLE, sparsity=0.5, backend="fast"), "backend must be one of"),
    ]
    if not vsa.kernel_available():
        cases.append((dict(grid=DIVISIBLE, sparsity=0.5, backend="kernel"), "needs fastvideo-kernel"))
    for kwargs, message in cases:
        with pytest.raises((ValueError, RuntimeError), match=message.replace("[", r"\[")) as err:
            video_sparse_attention(q, k, v, **kwargs)
        assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# enable_vsa on tiny transformers
# --------------------------------------------------------------------------------------------


def tiny_transformer(variant: str = "wan21_t2v", seed: int = 0):
    from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel

    from fv_accel.tiny.model import tiny_variant

    spec = tiny_variant(variant)
    cls = SkyReelsV2Transformer3DModel if spec.transformer_class == "SkyReelsV2Transformer3DModel" else WanTransformer3DModel
    torch.manual_seed(seed)
    return cls(**spec.transformer_config()).eval()


def tiny_inputs(transformer, frames=5, height=12, width=14, seed=0, per_token_timesteps=False):
    """A latent of 5 x 6 x 7 tokens (ragged tiles), 512 text tokens (what Wan's I2V attention
    expects), and image tokens when the transformer has image cross-attention."""
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    x = torch.randn(1, cfg.in_channels, frames, height, width, generator=g)
    tokens = frames * (height // 2) * (width // 2)
    t = torch.full((1, tokens), 500.0) if per_token_timesteps else torch.tensor([500.0])
    kwargs = dict(hidden_states=x, timestep=t, encoder_hidden_states=torch.randn(1, 512, cfg.text_dim, generator=g))
    if cfg.image_dim is not None:
        kwargs["encoder_hidden_states_image"] = torch.randn(1, 17, cfg.image_dim, generator=g)
    if getattr(cfg, "inject_sample_info", False):
        kwargs["fps"] = [SKYREELS_FPS_INDEX]  # SkyReels-V2 DF: the fps index its pipeline passes
    return kwargs


def forward(transformer, inputs):
    return transformer(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("variant", ["wan21_t2v", "wan21_i2v", "wan22_ti2v", "skyreels_v2"])
def test_sparsity_zero_keeps_the_output_and_sparsity_changes_it(variant):
    tr = tiny_transformer(variant)
    inputs = tiny_inputs(tr, per_token_timesteps=variant == "wan22_ti2v")
    with torch.no_grad():
        stock = forward(tr, inputs)
        controller = enable_vsa(tr, sparsity=0.0)
        dense = forward(tr, inputs)
        gates = [block.attn1.to_gate_compress for block in tr.blocks]
        assert enable_vsa(tr, sparsity=0.75) is controller and controller.sparsity == 0.75
        assert [block.attn1.to_gate_compress for block in tr.blocks] == gates  # the second call adds nothing
        sparse = forward(tr, inputs)
        with controller.dense():
            dense_view = forward(tr, inputs)
        assert controller.sparsity == 0.75
    assert (dense - stock).abs().max().item() <= 1e-5
    assert (sparse - stock).abs().max().item() > 1e-3
    assert torch.equal(dense_view, dense)
    assert all(isinstance(block.attn2.processor, type(tr.blocks[0].attn2.processor)) for block in tr.blocks)
    assert not isinstance(tr.blocks[0].attn2.processor, vsa.WanVSAProcessor)  # cross-attention stays dense


def test_gates_round_trip_through_save_and_load(tmp_path):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    tr = tiny_transformer()
    enable_vsa(tr, sparsity=0.5)
    gate_keys = sorted(k for k in tr.state_dict() if "to_gate_compress" in k)
    assert gate_keys == [f"blocks.{i}.attn1.to_gate_compress.{p}" for i in range(2) for p in ("bias", "weight")]
    with torch.no_grad():
        for block in tr.blocks:
            torch.nn.init.normal_(block.attn1.to_gate_compress.weight, std=0.2)
    inputs = tiny_inputs(tr)
    with torch.no_grad():
        expected = forward(tr, inputs)
    tr.save_pretrained(tmp_path)
    # A stock load drops the gates (unexpected keys); enable_vsa + load_vsa_gates put them back.
    loaded = WanTransformer3DModel.from_pretrained(tmp_path).eval()
    enable_vsa(loaded, sparsity=0.5)
    assert load_vsa_gates(loaded, tmp_path) == 4
    # Strict: a stock transformer with VSA enabled takes the whole saved state dict.
    fresh = WanTransformer3DModel(**tr.config).eval()
    enable_vsa(fresh, sparsity=0.5)
    fresh.load_state_dict(load_file(tmp_path / "diffusion_pytorch_model.safetensors"), strict=True)
    with torch.no_grad():
        assert torch.equal(forward(loaded, inputs), expected)
        assert torch.equal(forward(fresh, inputs), expected)


def test_fastwan_gate_keys_map_to_ours_and_load(tmp_path):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    assert vsa.fastwan_key_to_ours("blocks.7.to_gate_compress.weight") == "blocks.7.attn1.to_gate_compress.weight"
    assert vsa.fastwan_key_to_ours("blocks.7.to_gate_compress.bias") == "blocks.7.attn1.to_gate_compress.bias"
    assert vsa.fastwan_key_to_ours("blocks.7.attn1.to_q.weight") == "blocks.7.attn1.to_q.weight"
    # A FastWan diffusers-format folder: diffusers' keys plus blocks.N.to_gate_compress.{weight,bias}.
    tr = tiny_transformer()
    tr.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(3)
    state = dict(tr.state_dict())
    dim = tr.config.num_attention_heads * tr.config.attention_head_dim
    fastwan = {f"blocks.{i}.to_gate_compress.{p}": torch.randn(*((dim, dim) if p == "weight" else (dim,)), generator=g)
               for i in range(2) for p in ("weight", "bias")}
    save_file({**state, **fastwan}, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    loaded = WanTransformer3DModel.from_pretrained(tmp_path)
    enable_vsa(loaded, sparsity=0.8)
    assert load_vsa_gates(loaded, tmp_path) == 4
    for key, value in fastwan.items():
        assert torch.equal(loaded.state_dict()[vsa.fastwan_key_to_ours(key)], value)
    # A checkpoint without gates refuses in one line and loads nothing.
    stock = tmp_path / "stock"
    tr.save_pretrained(stock)
    with pytest.raises(KeyError, match="has no blocks.0.attn1.to_gate_compress.bias") as err:
        load_vsa_gates(loaded, stock)
    assert "\n" not in str(err.value)


def test_gradients_reach_the_projections_and_the_gate_and_checkpointing_replays_the_forward():
    tr = tiny_transformer()
    controller = enable_vsa(tr, sparsity=0.75)
    tr.train()
    inputs = tiny_inputs(tr)

    def grads(change_sparsity_before_backward: bool):
        tr.zero_grad(set_to_none=True)
        controller.set_sparsity(0.75)
        loss = forward(tr, inputs).square().mean()
        if change_sparsity_before_backward:
            controller.set_sparsity(0.0)
        loss.backward()
        return {n: p.grad.clone() for n, p in tr.named_parameters() if "blocks.0.attn1" in n}

    plain = grads(False)
    for name in ("to_q.weight", "to_k.weight", "to_v.weight", "to_gate_compress.weight", "to_gate_compress.bias"):
        assert plain[f"blocks.0.attn1.{name}"].abs().sum() > 0, name
    # With gradient checkpointing the backward recomputes each block with the forward's settings.
    tr.enable_gradient_checkpointing()
    replayed = grads(True)
    for name, grad in plain.items():
        assert torch.allclose(replayed[name], grad, atol=1e-6), name


def test_an_unsupported_family_refuses_in_one_line():
    from diffusers import LTXVideoTransformer3DModel

    from fv_accel.tiny.ltx_video import TINY_LTX_TRANSFORMER_CONFIG

    with pytest.raises(ValueError, match="does not serve LTXVideoTransformer3DModel: it serves Wan") as err:
        enable_vsa(LTXVideoTransformer3DModel(**TINY_LTX_TRANSFORMER_CONFIG), sparsity=0.5)
    assert "\n" not in str(err.value)


def test_a_block_causal_transformer_refuses_vsa():
    from fv_accel.models.attention import CausalSpec, install_causal_attention

    tr = tiny_transformer()
    install_causal_attention(tr, CausalSpec(block_size=1))
    with pytest.raises(ValueError, match="does not combine with block-causal attention"):
        enable_vsa(tr, sparsity=0.5)


def test_a_stock_wan_pipeline_samples_with_trained_gates(tiny_model_dir, tmp_path):
    from diffusers import WanPipeline

    trained = WanPipeline.from_pretrained(tiny_model_dir)
    enable_vsa(trained.transformer, sparsity=0.5)
    with torch.no_grad():
        for block in trained.transformer.blocks:
            torch.nn.init.normal_(block.attn1.to_gate_compress.weight, std=0.1)
    trained.transformer.save_pretrained(tmp_path / "transformer")

    pipe = WanPipeline.from_pretrained(tiny_model_dir)  # stock load: the gates are not in the model folder
    controller = enable_vsa(pipe.transformer, sparsity=0.5)
    assert load_vsa_gates(pipe.transformer, tmp_path / "transformer") == 4
    kwargs = dict(prompt="a red ball moving left", num_frames=17, height=64, width=64, num_inference_steps=2,
                  guidance_scale=3.0, output_type="latent")
    sparse = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    with controller.dense():
        dense = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    # Latents 16 x 5 x 8 x 8: a 5 x 4 x 4 token grid, 2 tiles, 1 kept at sparsity 0.5.
    assert sparse.shape == (1, 16, 5, 8, 8) and torch.isfinite(sparse).all()
    assert (sparse - dense).abs().max().item() > 1e-3


def test_the_benchmark_runs_its_quick_mode(tmp_path, monkeypatch):
    import importlib.util
    import json
    from pathlib import Path

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the benchmark sets it with setdefault at import
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "vsa.py"
    spec = importlib.util.spec_from_file_location("fv_bench_vsa", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--quick", "--rounds", "1", "--step-rounds", "1", "--sparsities", "0.8", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "vsa_quick.json").read_text())
    attention = data["attention"]
    assert attention["grid"] == [4, 8, 16] and attention["tiles"] == 8
    names = [v["name"] for v in attention["variants"]]
    assert names == ["dense", "gathered s=0.8", "flex s=0.8"]
    for v in attention["variants"]:
        assert v["fwd_s"]["n"] == 1 and v["fwd_s"]["median"] > 0
        assert ("fwd+bwd_s" in v) == (v["backend"] != "flex")  # no FlexAttention backward on CPU
        assert v["flops_fwd"] == vsa.attention_flops((4, 8, 16), 12, 128, v["sparsity"])
    (step,) = data["steps"]
    assert [v["name"] for v in step["variants"]] == ["dense", "vsa s=0.8"]
    assert all(v["step_s"]["median"] > 0 for v in step["variants"])
    md = (tmp_path / "vsa_quick.md").read_text()
    assert "| gathered s=0.8 | 2/8 |" in md and "## A training step" in md
