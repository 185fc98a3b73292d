"""Encoding clips and captions with a model's own VAE and text encoder (Hub id or local folder)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

TEXT_MAX_LENGTH = 512


class TextVideoEncoder:
    """The VAE (`AutoencoderKLWan`) and UMT5 text encoder of one model repo, in eval mode, no grad."""

    def __init__(
        self,
        model: str,
        *,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
        revision: Optional[str] = None,
        text_max_length: int = TEXT_MAX_LENGTH,
        vae_tiling: bool = False,
    ):
        from fv_accel.models.loading import load_text_encoder, load_vae

        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.text_max_length = text_max_length
        # Found like the transformer: Hub id (cache honoured offline) or local folder, clear errors.
        self.vae = load_vae(model, revision=revision, torch_dtype=dtype)
        self.tokenizer, self.text_encoder = load_text_encoder(model, revision=revision, torch_dtype=dtype)
        self.vae.to(self.device).eval().requires_grad_(False)
        self.text_encoder.to(self.device).eval().requires_grad_(False)
        if hasattr(self.vae, "enable_slicing") and self.device.type == "cuda":
            self.vae.enable_slicing()
        # Tiles change the latents slightly (blended seams): only on request, for high resolutions.
        if vae_tiling and hasattr(self.vae, "enable_tiling"):
            self.vae.enable_tiling()

    @torch.no_grad()
    def encode_video(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [F, H, W, 3] -> raw (unnormalised) latent [C, T, H/8, W/8], the posterior's mode."""
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None]
        video = video.to(self.device, torch.float32) / 127.5 - 1.0
        latent = self.vae.encode(video.to(self.dtype)).latent_dist.mode()
        return latent[0].float().cpu()

    @torch.no_grad()
    def encode_text(self, caption: str) -> torch.Tensor:
        """[L, D] embeddings of the caption's real tokens (padding is added by the loader)."""
        tok = self.tokenizer(
            [caption],
            padding="max_length",
            max_length=self.text_max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids = tok.input_ids.to(self.device)
        mask = tok.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, mask).last_hidden_state
        length = int(mask.sum())
        return hidden[0, :length].float().cpu()
