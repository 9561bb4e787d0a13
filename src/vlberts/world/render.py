"""Pixels of a scene: a textured, noisy background and lightly shaded, noisy shapes (numpy only).

The renderer takes its own random stream, so the pixels can change (more noise, other textures)
without changing any scene, caption or question of the world.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from vlberts.world.scene import Scene, shape_mask
from vlberts.world.vocab import COLOURS

NOISE_STD = 6.0  # std of the per-pixel noise on every channel, background and objects alike
BLOB_STD = (9.0, 6.0)  # luminance blobs of the coarse and the finer grid
CHROMA_BLOB_STD = 3.0


@lru_cache(maxsize=None)
def _upsample_matrix(size: int, grid: int) -> np.ndarray:
    """(size, grid) linear-interpolation weights: U @ G @ U.T smoothly upsamples a (grid, grid) array."""
    pos = np.linspace(0, grid - 1, size)
    lo = np.clip(np.floor(pos).astype(int), 0, grid - 2)
    frac = pos - lo
    u = np.zeros((size, grid), dtype=np.float32)
    u[np.arange(size), lo] = 1 - frac
    u[np.arange(size), lo + 1] = frac
    return u


def _smooth_field(rng: np.random.Generator, size: int, grid: int, std: float, channels: int = 1) -> np.ndarray:
    """Low-frequency noise: (channels, size, size) float32."""
    g = rng.standard_normal((channels, grid, grid), dtype=np.float32) * std
    u = _upsample_matrix(size, grid)
    return u @ g @ u.T  # (C, S, S)


_FILL = {name: np.asarray(rgb, dtype=np.float32)[:, None, None] for name, rgb in COLOURS.items()}  # (3, 1, 1)


@lru_cache(maxsize=None)
def _ramp(e: int) -> np.ndarray:
    """(e,) float32 from -0.5 to 0.5 across a canvas of side e."""
    return (np.arange(e, dtype=np.float32) - (e - 1) / 2) / max(e - 1, 1)


def render_scene(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """The scene's image as a (H, W, 3) uint8 RGB array."""
    H, W = scene.height, scene.width
    assert H == W, "the world renders square images"
    # Work channel-first: numpy is several times faster on (3, H, W) planes than on a trailing axis of 3.
    base = np.asarray(scene.background.rgb, dtype=np.float32)[:, None, None]  # (3, 1, 1)
    lum = _smooth_field(rng, H, 4, BLOB_STD[0]) + _smooth_field(rng, H, 9, BLOB_STD[1])  # (1, H, W)
    img = base + lum + _smooth_field(rng, H, 5, CHROMA_BLOB_STD, channels=3)  # (3, H, W)

    n = len(scene.objects)
    tilt = rng.uniform(-1, 1, size=(n, 2)).astype(np.float32)  # shading direction per object
    strength = rng.uniform(0.04, 0.08, size=n).astype(np.float32)
    for k, obj in enumerate(scene.objects):  # draw order: later objects occlude earlier ones
        e = obj.extent
        x, y = obj.origin
        # Slight directional shading: brightness varies by about +-5% across the shape.
        ramp = _ramp(e)
        shade = (0.98 + strength[k] * (tilt[k, 0] * ramp[None, :] + tilt[k, 1] * ramp[:, None]))  # (e, e)
        colour = _FILL[obj.colour] * shade[None]  # (3, e, e)
        np.copyto(img[:, y:y + e, x:x + e], colour, where=shape_mask(obj.shape, e)[None])

    # Uniform noise with the NOISE_STD standard deviation (4x cheaper to draw than Gaussian); the
    # +0.5 turns the truncating uint8 cast into rounding.
    width = np.float32(NOISE_STD * 12**0.5)
    img += rng.random((3, H, W), dtype=np.float32) * width + np.float32(0.5 - width / 2)
    np.clip(img, 0, 255, out=img)
    return np.ascontiguousarray(img.astype(np.uint8).transpose(1, 2, 0))  # (H, W, 3)
