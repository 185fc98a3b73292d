"""How close generated clips come to the clips of their caption: the measure of the multimodal tiny
world (`training.data.tiny_world: multimodal`), where each caption has many clips.

A sampler that averages a caption's clips draws a blur far from every one of them; a good sampler
lands near one. So a sample is scored against the NEAREST clip of its caption, two ways:

- latent distance: the root mean square, over the normalised latent [C, T, H, W], of the sample's
  difference to the clip's latent (the latents the run trained on);
- track distance: the mean distance in pixels between the shape's centre in the sample's frames and
  in the clip's (`motion.shape_centres`, `motion.track_distance`), both decoded by the dataset's
  tiny VAE (the same blur on both sides).

The clips' latents and tracks are read from the cached tiny dataset (`ClipModes.load`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fv_accel.tiny.motion import shape_centres, track_distance


@dataclass
class ClipModes:
    """The clips of a tiny dataset grouped by caption: normalised latents [N, C, T, H, W] and
    centre tracks [N, F, 2] per caption, with the VAE and latent statistics that decode them."""

    latents: dict[str, torch.Tensor]
    tracks: dict[str, np.ndarray]
    vae: Any
    latents_mean: torch.Tensor  # [1, C, 1, 1, 1]
    latents_std: torch.Tensor
    data_dir: Path  # the tiny dataset folder (latents/, tiny-model/)

    @classmethod
    def load(cls, data_dir: Path) -> "ClipModes":
        """From a tiny dataset folder (`tiny_dataset_dir`: latents/ and tiny-model/), normalised with
        the statistics its fv_dataset.json records (those the training run normalises with)."""
        from diffusers import AutoencoderKLWan

        from fv_accel.data.loader import LatentDataset
        from fv_accel.data.schema import read_dataset_info

        data_dir = Path(data_dir)
        info = read_dataset_info(str(data_dir / "latents"))
        if not info.get("latents_mean") or not info.get("latents_std"):
            raise ValueError(f"{data_dir / 'latents'}: its dataset info records no latents_mean/latents_std")
        mean = torch.tensor(info["latents_mean"], dtype=torch.float32).view(1, -1, 1, 1, 1)
        std = torch.tensor(info["latents_std"], dtype=torch.float32).view(1, -1, 1, 1, 1)
        dataset = LatentDataset(str(data_dir / "latents"))
        latents: dict[str, list[torch.Tensor]] = {}
        for row in range(len(dataset)):
            item = dataset[(row, 0, 0)]
            latents.setdefault(item["caption"], []).append((item["vae_latent"][None].float() - mean) / std)
        vae = AutoencoderKLWan.from_pretrained(str(data_dir / "tiny-model"), subfolder="vae").eval()
        modes = cls(latents={c: torch.cat(z) for c, z in latents.items()}, tracks={}, vae=vae,
                    latents_mean=mean, latents_std=std, data_dir=data_dir)
        # The clips' tracks as `motion.training_tracks` reads them: decoded by the dataset's VAE.
        modes.tracks = {c: np.stack([shape_centres(f) for f in modes.decode(z)]) for c, z in modes.latents.items()}
        return modes

    @property
    def captions(self) -> list[str]:
        return list(self.latents)

    def clips_of(self, caption: str) -> int:
        return self._check(caption).shape[0]

    def _check(self, caption: str) -> torch.Tensor:
        if caption not in self.latents:
            raise KeyError(f"caption {caption!r} is none of the dataset's: {self.captions}")
        return self.latents[caption]

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Normalised latents [B, C, T, H, W] -> uint8 frames [B, F, H, W, 3] (the tiny VAE)."""
        from fv_accel.sampling import decode_latents

        return decode_latents(self.vae, latents, self.latents_mean, self.latents_std)

    def latent_distances(self, latents: torch.Tensor, caption: str) -> torch.Tensor:
        """RMS latent distance of each sample to each clip of the caption: [B, N]."""
        clips = self._check(caption)
        if tuple(latents.shape[1:]) != tuple(clips.shape[1:]):
            raise ValueError(f"latents {tuple(latents.shape[1:])} vs the clips' {tuple(clips.shape[1:])}")
        diff = latents.detach().float().cpu()[:, None] - clips[None]
        return diff.pow(2).flatten(2).mean(-1).sqrt()

    def track_distances(self, latents: torch.Tensor, caption: str) -> np.ndarray:
        """Track distance in pixels of each decoded sample to each clip of the caption: [B, N]."""
        self._check(caption)
        refs = self.tracks[caption]
        frames = self.decode(latents)
        return np.array([[track_distance(shape_centres(f), ref) for ref in refs] for f in frames])

    def nearest(self, latents: torch.Tensor, caption: str) -> dict[str, Any]:
        """Each sample's distance to the nearest clip of its caption: {"latent": [B] RMS, "track": [B]
        pixels, "latent_clip" / "track_clip": [B] the nearest clip's index among the caption's}
        (the two nearest clips chosen separately)."""
        lat = self.latent_distances(latents, caption)
        trk = self.track_distances(latents, caption)
        # A sample with no shape to find (a flat frame throughout) has no track: NaN, clip -1.
        found = np.isfinite(trk).any(axis=1)
        filled = np.where(np.isfinite(trk), trk, np.inf)
        return {
            "latent": lat.min(dim=1).values.numpy(),
            "latent_clip": lat.argmin(dim=1).numpy(),
            "track": np.where(found, filled.min(axis=1), np.nan),
            "track_clip": np.where(found, filled.argmin(axis=1), -1),
        }
