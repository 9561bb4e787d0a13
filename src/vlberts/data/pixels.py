"""Image pixels for end-to-end VL-BERT (paper §3.2, §4.1: the Fast R-CNN runs inside the model on the image).

`PixelLoader(DIR, pattern, size)` reads image `image_id` from DIR/pattern.format(image_id=...), e.g. the
world's `{image_id:012d}.png` (WORLD/images) or COCO's `COCO_train2014_{image_id:012d}.jpg`, and returns a
(3, size, size) float tensor:

    PIL open -> RGB -> resize to size x size (bilinear) -> / 255 -> (x - mean) / std per channel

with ImageNet's channel statistics (`IMAGENET_MEAN`, `IMAGENET_STD`, torchvision's convention for
ImageNet-trained CNNs; the paper's ResNet-101 reads images normalised this way). Resizing to a square
changes the aspect ratio but keeps every normalised box valid: region boxes are stored as fractions of the
image width and height (`data.regions.load_regions`), so a box covers the same pixels of the resized image.
Images are decoded once and kept in a small LRU cache keyed by image id (`cache_size` images: 512 images of
128 x 128 hold ~100 MB), enough for the embedded world; a missing or unreadable file is a one-line error
naming the file and the image id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vlberts.errors import VlbertsError

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # per RGB channel, of pixels scaled to [0, 1]
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_PATTERN = "{image_id:012d}.png"  # the embedded world's naming (world/build.py: OUT/images/)
DEFAULT_SIZE = 128  # the world's image size; pixels per side the model's CNN reads


def image_file(root: str | Path, pattern: str, image_id: str | int) -> Path:
    """DIR/pattern with the image id filled in (as an integer when it is all digits, so `:012d` works)."""
    key: str | int = int(image_id) if str(image_id).isdigit() else str(image_id)
    try:
        name = pattern.format(image_id=key)
    except (ValueError, KeyError, IndexError) as e:
        raise VlbertsError(f"--image_pattern {pattern!r} cannot name image {image_id!r} ({e}); "
                           "it must use the field {image_id}, e.g. '{image_id:012d}.png'", record=f"image {image_id}") from None
    return Path(root) / name


def normalise(rgb: np.ndarray) -> Tensor:
    """(H, W, 3) uint8 RGB -> (3, H, W) float32: scaled to [0, 1], then ImageNet mean/std per channel."""
    x = torch.from_numpy(np.ascontiguousarray(rgb, dtype=np.uint8)).permute(2, 0, 1).float() / 255.0  # (3, H, W)
    mean = torch.tensor(IMAGENET_MEAN)[:, None, None]
    std = torch.tensor(IMAGENET_STD)[:, None, None]
    return (x - mean) / std


class PixelLoader:
    """Image id -> (3, size, size) normalised pixels (module docstring); deterministic in the image id."""

    def __init__(self, root: str | Path, pattern: str = DEFAULT_PATTERN, size: int = DEFAULT_SIZE,
                 cache_size: int = 512):
        if size < 1:
            raise VlbertsError(f"--pixel_size must be positive, got {size}")
        self.root = Path(root)
        if not self.root.is_dir():
            raise VlbertsError("image directory not found (--images)", path=self.root)
        self.pattern, self.size, self.cache_size = pattern, size, cache_size
        self._cache: OrderedDict[str, Tensor] = OrderedDict()

    def path(self, image_id: str | int) -> Path:
        return image_file(self.root, self.pattern, image_id)

    def check(self, image_ids: Iterable[str]) -> None:
        """A one-line error for the first image whose file is missing (before training starts)."""
        ids = list(dict.fromkeys(str(i) for i in image_ids))
        missing = [i for i in ids if not self.path(i).is_file()]
        if missing:
            raise VlbertsError(f"image file missing ({len(missing)} of {len(ids)} images lack theirs; "
                               f"--image_pattern is {self.pattern!r})", path=self.path(missing[0]),
                               record=f"image {missing[0]}")

    def get(self, image_id: str | int) -> Tensor:
        """(3, size, size) float32 pixels of `image_id` (a cached tensor: do not modify it in place)."""
        key = str(image_id)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        pixels = self._load(key)
        self._cache[key] = pixels
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return pixels

    def _load(self, image_id: str) -> Tensor:
        from PIL import Image, UnidentifiedImageError

        path = self.path(image_id)
        try:
            with Image.open(path) as im:
                rgb = im.convert("RGB").resize((self.size, self.size), Image.Resampling.BILINEAR)
                arr = np.array(rgb, dtype=np.uint8)  # (S, S, 3), a writable copy
        except FileNotFoundError:
            raise VlbertsError("image file not found", path=path, record=f"image {image_id}") from None
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise VlbertsError(f"cannot read the image ({type(e).__name__}: {e})", path=path,
                               record=f"image {image_id}") from None
        return normalise(arr)
