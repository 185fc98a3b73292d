"""A trained decoder for the tiny Wan 2.1 VAE: its encoder stays as drawn from its seed (so every
latent, and the latent statistics, are those of the seeded random VAE) and its decoder (with
`post_quant_conv`) is trained to invert that encoder on procedural clips, once, then cached.
`write_tiny_variant(..., trained_decoder=True)` builds a tiny model with it; off by default.

Why off: the random encoder's latents are hard to invert locally. Measured on 8-16 held-out
9-frame 32x32 clips (pixels in [-1, 1]): the random decoder reconstructs them with MSE 0.41-0.50,
a flat colour per clip 0.11; this recipe's decoder reaches 0.12-0.15 after 100-400 Adam steps
(about 0.4 s of one CPU core each at batch 8): the right background brightness, no shapes. A
decoder widened to 16 channels, zero-initialised residual branches, a plain 64-channel conv
decoder (0.096 after 150 steps) and training encoder and decoder together (0.24 after 100 steps)
do no better within a few hundred steps. Longer training does get there: 0.086 after 500 steps,
0.077 after 1,200 and 0.062 after 2,100 (batch 8, 128 clips, learning rate 2e-3; about 0.3 s a
step on two idle cores), when the decoded clips show blobs of about the right colour moving in
the right direction: roughly ten minutes of CPU, once per cache, which the recipe below does not
spend yet.

The training is seeded: precomputed latents of `train_clips` clips, whitened by
`post_quant_conv` (a 1x1x1 convolution; the encoder's channel vectors have a small spread around
a large offset), then Adam on the MSE of the decoded pixels before the VAE's final clamp. The
decoder's weights (`decoder.*`, `post_quant_conv.*`) are written as safetensors under the tiny
cache folder (`$FV_ACCEL_CACHE`, else `~/.cache/fv_accel`), named by a hash of the VAE config, its
seed, the recipe and the clip generator's version, with the figures of the training in the
file's metadata. Concurrent first uses (several processes of a launch) wait on a file lock, and
the file is moved into place complete; a cache file that cannot be read is trained again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

logger = logging.getLogger(__name__)

# How the decoder is trained. Any change here names a new cache file.
DECODER_RECIPE = dict(
    train_clips=64,  # procedural clips (clip seed below), encoded once
    clip_seed=90_001,  # not a seed of any tiny dataset's clips (the demo's data use 0 and 1)
    # 3 latent frames: the first (1 frame), the second (4 frames, its causal cache from a 1-frame
    # chunk) and a third (the steady state every later latent frame decodes in).
    num_frames=9,
    size=32,
    steps=300,
    batch_size=8,
    learning_rate=2e-3,
    warmup_steps=20,
    heldout_clips=16,
    heldout_seed=90_002,
)
# Bumped when fv_accel.tiny.clips draws or renders clips differently.
CLIPS_VERSION = 1
DECODER_PREFIXES = ("decoder.", "post_quant_conv.")


def clip_batch(n: int, seed: int, *, num_frames: int, size: int) -> torch.Tensor:
    """`n` procedural clips as a [n, 3, F, H, W] float batch in [-1, 1]."""
    from fv_accel.tiny.clips import render_clip, tiny_clip_specs

    clips = [render_clip(s, num_frames=num_frames, height=size, width=size) for s in tiny_clip_specs(n, seed=seed)]
    return torch.stack([torch.from_numpy(c).permute(3, 0, 1, 2) for c in clips]).float() / 127.5 - 1.0


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """`vae.decode` without its final clamp to [-1, 1] (the clamp would stop the gradient of any
    pixel outside it): the same frame-by-frame causal decoding with the VAE's feature cache."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, dim=2)


@torch.no_grad()
def encode_mode(vae, video: torch.Tensor, batch: int = 64) -> torch.Tensor:
    return torch.cat([vae.encode(video[i : i + batch]).latent_dist.mode() for i in range(0, len(video), batch)])


@torch.no_grad()
def reconstruction_errors(vae, video: torch.Tensor) -> dict[str, float]:
    """Pixel MSE (pixels in [-1, 1]) of the VAE's reconstruction of `video`, and that of the
    flat-colour baseline (each clip replaced by its mean colour)."""
    recon = vae.decode(encode_mode(vae, video)).sample
    flat = video.mean(dim=(2, 3, 4), keepdim=True)
    return {"mse": float(((recon - video) ** 2).mean()), "flat_colour_mse": float(((flat - video) ** 2).mean())}


def _whiten_post_quant_conv(vae, z: torch.Tensor) -> None:
    """Set post_quant_conv to the ZCA whitening of the latents' channel vectors."""
    channels = z.shape[1]
    v = z.permute(0, 2, 3, 4, 1).reshape(-1, channels).double()
    mean = v.mean(0)
    eigval, eigvec = torch.linalg.eigh(torch.cov(v.T))
    w = eigvec @ torch.diag(eigval.clamp_min(1e-8).rsqrt()) @ eigvec.T
    with torch.no_grad():
        vae.post_quant_conv.weight.copy_(w.float().view(channels, channels, 1, 1, 1))
        vae.post_quant_conv.bias.copy_((-(w @ mean)).float())


def train_decoder(vae, recipe: Optional[dict] = None, seed: int = 0) -> dict[str, float]:
    """Train `vae`'s decoder and post_quant_conv (in place) to invert its frozen encoder; returns
    the figures of the training (reconstruction MSE on held-out clips, before and after, the flat
    colour MSE on them, and the seconds it took)."""
    t0 = time.perf_counter()
    r = recipe or DECODER_RECIPE
    train = clip_batch(r["train_clips"], r["clip_seed"], num_frames=r["num_frames"], size=r["size"])
    heldout = clip_batch(r["heldout_clips"], r["heldout_seed"], num_frames=r["num_frames"], size=r["size"])
    vae.eval().requires_grad_(False)
    before = reconstruction_errors(vae, heldout)
    z = encode_mode(vae, train)
    _whiten_post_quant_conv(vae, z)
    params = [p for name, p in vae.named_parameters() if name.startswith(DECODER_PREFIXES)]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(params, lr=r["learning_rate"])
    warmup = r["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup))
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for _ in range(r["steps"]):
            idx = torch.randint(0, len(train), (r["batch_size"],), generator=generator)
            loss = ((decode_unclamped(vae, z[idx]) - train[idx]) ** 2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    vae.requires_grad_(False)
    after = reconstruction_errors(vae, heldout)
    return {
        "heldout_mse": after["mse"],
        "heldout_mse_random_decoder": before["mse"],
        "heldout_flat_colour_mse": after["flat_colour_mse"],
        "train_seconds": time.perf_counter() - t0,
    }


def decoder_cache_key(config: dict, seed: int, recipe: Optional[dict] = None) -> str:
    settings = {"vae": dict(sorted(config.items())), "seed": seed, "recipe": recipe or DECODER_RECIPE, "clips": CLIPS_VERSION}
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


def decoder_cache_path(config: dict, seed: int, cache_dir: Optional[str | Path] = None) -> Path:
    from fv_accel.tiny.cache import default_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"tiny-vae-decoder-{decoder_cache_key(config, seed)}.safetensors"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if absent) across processes; a no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent first uses then both train; the rename keeps the file whole
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_cache(path: Path, expected: dict[str, torch.Tensor]) -> Optional[tuple[dict[str, torch.Tensor], dict]]:
    """(decoder state, figures) of a cache file, or None (with a warning) if it is not a complete
    decoder of this VAE."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata() or {}
        if set(state) != set(expected) or any(state[k].shape != v.shape for k, v in expected.items()):
            raise ValueError("its tensors are not this VAE's decoder")
        figures = json.loads(meta.get("figures", "{}"))
    except Exception as err:  # noqa: BLE001 - any unreadable cache file is rebuilt
        logger.warning("tiny VAE decoder cache %s is unusable (%s: %s); training it again", path, type(err).__name__, err)
        return None
    return state, figures


def trained_decoder_state(vae, config: dict, seed: int, cache_dir: Optional[str | Path] = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(decoder state, figures) for the tiny VAE `vae` drawn from `seed` with `config`: read from
    the cache, else trained on a copy of `vae` and written there."""
    import copy

    from safetensors.torch import save_file

    path = decoder_cache_path(config, seed, cache_dir)
    expected = {k: v for k, v in vae.state_dict().items() if k.startswith(DECODER_PREFIXES)}
    if path.is_file():
        cached = _read_cache(path, expected)
        if cached is not None:
            return cached
    with _file_lock(path.with_name(path.name + ".lock")):
        if path.is_file():  # another process trained it while this one waited
            cached = _read_cache(path, expected)
            if cached is not None:
                return cached
        logger.info("training the tiny VAE's decoder once (cached in %s)", path)
        student = copy.deepcopy(vae)
        figures = train_decoder(student, seed=seed)
        state = {k: v.detach().contiguous().clone() for k, v in student.state_dict().items() if k.startswith(DECODER_PREFIXES)}
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        save_file(state, str(partial), metadata={"figures": json.dumps(figures), "recipe": json.dumps(DECODER_RECIPE)})
        os.replace(partial, path)
        logger.info(
            "tiny VAE decoder trained in %.1fs: reconstruction MSE %.4f on held-out clips (flat colour %.4f, random decoder %.4f)",
            figures["train_seconds"], figures["heldout_mse"], figures["heldout_flat_colour_mse"], figures["heldout_mse_random_decoder"],
        )
    return state, figures


def with_trained_decoder(vae, config: dict, seed: int, cache_dir: Optional[str | Path] = None):
    """`vae` (the tiny VAE drawn from `seed` with `config`) with its decoder replaced by the trained one."""
    state, _ = trained_decoder_state(vae, config, seed, cache_dir)
    missing = vae.load_state_dict(state, strict=False).missing_keys
    assert not [k for k in missing if k.startswith(DECODER_PREFIXES)], missing
    return vae
