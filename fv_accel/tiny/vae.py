"""Weights for the tiny Wan 2.1 VAE that reconstruct the tiny clips, set in closed form.

The tiny VAE keeps the Wan 2.1 architecture (`AutoencoderKLWan`, 8x spatial and 4x temporal
compression, causal chunks of 1 + 4k frames), so the stock pipelines load it; only its weights are
set here, from a seed, with no training:

- **Encoder**: each latent frame is the mean colour of each 8x8-pixel cell over its frames (the
  first latent frame: frame 0; each later one: the mean of its 4 frames), mixed into the 16 latent
  channels by a seeded 16x3 matrix `M` with orthogonal columns. Every downsampling convolution
  averages 2x2 pixels (taps that never reach the zero padding), every temporal one averages the
  chunk's frames, residual branches and attention projections are zero (identity blocks).
- **Decoder**: `pinv(M)` back to colour, then each 2x upsampling is bilinear (nearest-exact
  upsampling followed by the [1/4, 1/2, 1/4] filter in each direction) and each temporal one
  repeats the frame, so a latent cell decodes to a smooth blob of its colour.
- **The nonlinearities stay exact**: the encoder's and decoder's output heads RMS-normalise the
  channels and apply SiLU. A constant channel of value `K` rides along with the colour (set by
  a bias, averaged and upsampled like the colour), so the norm is that constant to within
  `|rgb|^2 / K^2` (6e-4 at most for K = 100) and the normalisation also undoes the darkening of the
  border pixels by the upsampling's zero padding (colour and constant darken alike). Each colour is
  carried as a pair (+c, -c), and the output convolution takes `SiLU(c) - SiLU(-c) = c`.
- The log-variance half of the encoder's output is -30 (the clamp's floor), so a sampled latent is
  the mode to within 3e-7.

Measured on 16 procedural 21-frame 48x48 clips (pixels in [-1, 1]): reconstruction MSE 0.031, the
flat colour of each clip 0.112; a randomly initialised tiny VAE of the same config, which draws
much the same picture for any latent, 0.557. The reconstruction is as sharp as 8x8 cells allow: shapes come back as
soft blobs of their colour at their place, moving as they move.
"""

from __future__ import annotations

import torch

# The constant channel's value (see the module docstring).
CONSTANT = 100.0
# Bilinear 2x upsampling after nearest-exact upsampling: the [1/4, 1/2, 1/4] filter.
_BILINEAR = torch.tensor([0.25, 0.5, 0.25])
# The log-variance the encoder reports (DiagonalGaussianDistribution clamps at -30).
_LOGVAR = -30.0


def latent_mixing(seed: int, z_dim: int = 16) -> torch.Tensor:
    """The seeded [z_dim, 3] matrix taking a cell's colour to its latent channels: orthogonal
    columns of norm sqrt(z_dim / 3), so each latent channel has about the spread of one colour."""
    generator = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(z_dim, z_dim, generator=generator, dtype=torch.float64))
    return (q[:, :3] * (z_dim / 3) ** 0.5).float()


def _check_layout(vae) -> None:
    """The layout the construction needs: 3 colour channels in and out; one width of at least 8
    everywhere (identity shortcuts in the encoder; 3 colour pairs and the constant at each head; 4
    channels, colour and the constant, through the decoder's upsampling, which halves the width)."""
    cfg = vae.config
    problems = []
    if cfg.get("patch_size") or cfg.get("is_residual"):
        problems.append("the Wan 2.2 layout (patchified, residual blocks)")
    if vae.encoder.conv_in.in_channels != 3 or vae.decoder.conv_out.out_channels != 3:
        problems.append("pixels of other than 3 channels")
    if set(cfg.dim_mult) != {1} or cfg.base_dim < 8:
        problems.append(f"encoder widths base_dim {cfg.base_dim} x dim_mult {list(cfg.dim_mult)} (all 1, base_dim at least 8 needed)")
    if cfg.get("decoder_base_dim") not in (None, cfg.base_dim):
        problems.append(f"decoder_base_dim {cfg.decoder_base_dim} other than base_dim")
    if problems:
        raise ValueError(f"the closed-form tiny VAE weights do not fit this AutoencoderKLWan config: {'; '.join(problems)}")


@torch.no_grad()
def set_reconstructing_weights(vae, seed: int):
    """Set every weight of `vae` (a tiny Wan 2.1 `AutoencoderKLWan`, in place) so that it encodes
    and decodes as the module docstring says; returns `vae`."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample

    _check_layout(vae)
    for p in vae.parameters():
        p.zero_()
    z_dim = vae.config.z_dim
    mixing = latent_mixing(seed, z_dim)
    unmixing = torch.linalg.pinv(mixing)
    enc, dec = vae.encoder, vae.decoder
    # A causal 3x3x3 convolution's tap on the current frame and pixel.
    now = (2, 1, 1)

    # Encoder channels: +R -R +G -G +B -B K, then zeros.
    for c in range(3):
        enc.conv_in.weight[(2 * c, c, *now)] = 1.0
        enc.conv_in.weight[(2 * c + 1, c, *now)] = -1.0
    enc.conv_in.bias[6] = CONSTANT
    for m in enc.modules():
        if isinstance(m, WanResample):
            conv = m.resample[1]  # 3x3, stride 2, after zero padding on the right and bottom
            for o in range(conv.out_channels):
                conv.weight[o, o, :2, :2] = 0.25
            if hasattr(m, "time_conv"):  # kernel 3, stride 2, over (previous frame, the chunk's frames)
                for o in range(m.time_conv.out_channels):
                    m.time_conv.weight[o, o, 1:] = 0.5
    _set_head(enc.norm_out.gamma)
    for c in range(3):
        enc.conv_out.weight[(slice(0, z_dim), 2 * c, *now)] = mixing[:, c]
        enc.conv_out.weight[(slice(0, z_dim), 2 * c + 1, *now)] = -mixing[:, c]
    enc.conv_out.bias[z_dim:] = _LOGVAR
    for conv in (vae.quant_conv, vae.post_quant_conv):
        conv.weight[:, :, 0, 0, 0] = torch.eye(conv.out_channels)

    # Decoder channels: R G B K (then zeros) up to its last block, which widens them to
    # +R -R +G -G +B -B K for the head.
    for c in range(3):
        dec.conv_in.weight[(c, slice(None), *now)] = unmixing[c]
    dec.conv_in.bias[3] = CONSTANT
    for m in dec.modules():
        if isinstance(m, WanResample):
            conv = m.resample[1]  # 3x3, padding 1, after nearest-exact 2x upsampling
            for o in range(4):
                conv.weight[o, o] = torch.outer(_BILINEAR, _BILINEAR)
            if hasattr(m, "time_conv"):  # dim -> 2 * dim channels: the two frames each frame becomes
                dim = m.time_conv.in_channels
                for o in range(dim):
                    m.time_conv.weight[o, o, 2] = 1.0
                    m.time_conv.weight[dim + o, o, 2] = 1.0
    last = len(dec.up_blocks) - 1
    for i, block in enumerate(dec.up_blocks):
        for resnet in block.resnets:
            if isinstance(resnet.conv_shortcut, torch.nn.Conv3d):
                w = resnet.conv_shortcut.weight
                if i == last:
                    for c in range(3):
                        w[2 * c, c] = 1.0
                        w[2 * c + 1, c] = -1.0
                    w[6, 3] = 1.0
                else:
                    for o in range(4):
                        w[o, o] = 1.0
    _set_head(dec.norm_out.gamma)
    for c in range(3):
        dec.conv_out.weight[(c, 2 * c, *now)] = 1.0
        dec.conv_out.weight[(c, 2 * c + 1, *now)] = -1.0
    # Every residual branch (conv2) and attention projection stays zero: those blocks are identities.
    return vae


def _set_head(gamma: torch.Tensor) -> None:
    """RMS-norm gains that turn (+c, -c) pairs over the constant channel back into +-c: the norm
    is CONSTANT and the layer multiplies by sqrt(channels)."""
    gamma[:6] = CONSTANT / gamma.shape[0] ** 0.5
