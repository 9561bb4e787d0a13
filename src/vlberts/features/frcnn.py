"""Region features from an image folder with a Faster R-CNN built on torchvision (SPEC §2: "a Faster R-CNN
extractor built on torchvision that turns an image folder into the canonical store; the user supplies the
detector weights file").

The architecture is torchvision's `fasterrcnn_resnet50_fpn` or `fasterrcnn_resnet50_fpn_v2`, built with
no weights (nothing is downloaded) and filled from the user's weights file (read with
`weights_only=True`; e.g. torchvision's released COCO checkpoints); which of the two, and the number of
classes, come from the file's keys and shapes. Each image goes through the detector the way BUTD's
extractor treats its Caffe detector (formats-and-metrics.md §1.1):

1. the region proposal network's proposals (after its NMS; `proposals` per image, torchvision's
   `rpn_post_nms_top_n_test`);
2. the box head on every proposal: the class distribution (softmax over the C classes, background in
   column 0 as torchvision lays them out) and the region feature, the box head's output that the
   classifier reads (1024-d for both architectures);
3. BUTD's box selection over the proposals (per-class NMS, each box's best surviving score, then the
   threshold and the min / max counts: `selection.py`);
4. the kept proposals themselves, not the class-regressed boxes ("keep the original boxes", as BUTD
   does), in pixels of the original image.

With given boxes (`--boxes FILE`: COCO instances, e.g. RefCOCO+'s `instances.json` for its ground-truth
track, or `{image id: [[x1, y1, x2, y2], ...]}` in pixels) steps 1 and 3 are skipped: the box head describes
exactly those boxes, in the file's order, and only the images the file names are extracted, under the file's
image ids (a COCO id matches a file named by it, `42.png`, or ending in it, `COCO_train2014_000000000042.jpg`).

`obj_id` / `obj_conf` are the arg-max and max over the non-background columns (0-based, LXMERT's
convention). Image ids are the file names' stems, an all-digit stem as its integer ("000000000042.png"
-> "42", BUTD's ids), any other as it is ("COCO_val2014_000000131089", LXMERT's ids).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from vlberts.errors import first_line, VlbertsError
from vlberts.features.importers import read_vocab
from vlberts.features.record import RegionRecord, StoreMetadata
from vlberts.features.selection import SelectionConfig, select_boxes
from vlberts.features.store import RegionStoreWriter
from vlberts.io import read_json
from vlberts.models.weights import load_into, read_state_dict

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
# Keys that tell the two torchvision architectures apart: v1's box head is two linear layers (TwoMLPHead),
# v2's four convolutions and a linear layer (FastRCNNConvFCHead).
ARCH_KEYS = {"fasterrcnn_resnet50_fpn": "roi_heads.box_head.fc6.weight",
             "fasterrcnn_resnet50_fpn_v2": "roi_heads.box_head.5.weight"}


@dataclass(frozen=True)
class DetectorSettings:
    min_size: int = 800  # torchvision's resize: shorter side to this ...
    max_size: int = 1333  # ... unless the longer side would pass this
    proposals: int = 1000  # RPN proposals kept per image after its NMS (torchvision's test default)


def build_detector(weights: str | Path, settings: DetectorSettings = DetectorSettings()) -> tuple[torch.nn.Module, str, int]:
    """(the detector in eval mode with the file's weights, its architecture name, its number of classes)."""
    from torchvision.models.detection import fasterrcnn_resnet50_fpn, fasterrcnn_resnet50_fpn_v2

    sd = read_state_dict(weights)
    arch = next((name for name, key in ARCH_KEYS.items() if key in sd), None)
    if arch is None:
        raise VlbertsError("not a torchvision Faster R-CNN (ResNet-50 FPN, v1 or v2) state dict: no "
                           f"{' or '.join(ARCH_KEYS.values())}", path=weights)
    cls = sd.get("roi_heads.box_predictor.cls_score.weight")
    if cls is None or cls.ndim != 2:
        raise VlbertsError("no box classifier (roi_heads.box_predictor.cls_score.weight)", path=weights)
    num_classes = int(cls.shape[0])
    builder = fasterrcnn_resnet50_fpn if arch == "fasterrcnn_resnet50_fpn" else fasterrcnn_resnet50_fpn_v2
    model = builder(weights=None, weights_backbone=None, num_classes=num_classes, min_size=settings.min_size,
                    max_size=settings.max_size, rpn_post_nms_top_n_test=settings.proposals)
    load_into(model, sd, source=weights)
    return model.eval(), arch, num_classes


def image_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise VlbertsError("not a directory of images", path=folder)
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise VlbertsError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in this directory", path=folder)
    return files


def image_id_of(path: Path) -> str:
    return str(int(path.stem)) if path.stem.isdigit() else path.stem


def read_image(path: Path) -> torch.Tensor:
    """(3, H, W) float in [0, 1], RGB; an unreadable file is a one-line error naming it."""
    try:
        with Image.open(path) as im:
            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise VlbertsError(f"cannot read as an image ({first_line(e)})", path=path) from None
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1).float().div_(255.0)


def read_given_boxes(path: str | Path) -> dict[str, np.ndarray]:
    """Image id -> (N, 4) float32 boxes, xyxy pixels, from COCO instances (`annotations` with `image_id` and
    `bbox` [x, y, w, h], in the file's order) or a `{image id: [[x1, y1, x2, y2], ...]}` object. A box that is
    not four finite numbers of positive width and height is a one-line error naming the record."""
    data = read_json(path)
    boxes: dict[str, list[list[float]]] = {}
    if isinstance(data, dict) and isinstance(data.get("annotations"), list):
        for i, ann in enumerate(data["annotations"]):
            if not isinstance(ann, dict) or "image_id" not in ann or "bbox" not in ann:
                raise VlbertsError("an annotation needs image_id and bbox", path=path, record=f"annotations[{i}]")
            x, y, w, h = _four(ann["bbox"], path, f"annotations[{i}]")
            boxes.setdefault(str(ann["image_id"]), []).append([x, y, x + w, y + h])
    elif isinstance(data, dict):
        for image_id, rows in data.items():
            if not isinstance(rows, list):
                raise VlbertsError("expected a list of [x1, y1, x2, y2] boxes", path=path, record=image_id)
            boxes[str(image_id)] = [list(_four(b, path, f"{image_id}[{j}]")) for j, b in enumerate(rows)]
    else:
        raise VlbertsError("expected COCO instances (with annotations) or an {image id: boxes} object", path=path)
    out = {}
    for image_id, rows in boxes.items():
        arr = np.asarray(rows, dtype=np.float32).reshape(-1, 4)
        if ((arr[:, 2] <= arr[:, 0]) | (arr[:, 3] <= arr[:, 1])).any():
            raise VlbertsError("a box has no positive width and height", path=path, record=image_id)
        out[image_id] = arr
    return out


def _four(box: object, path: str | Path, record: str) -> tuple[float, float, float, float]:
    if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                             and np.isfinite(v) for v in box)):
        raise VlbertsError(f"a box must be four finite numbers, got {box!r}", path=path, record=record)
    return tuple(float(v) for v in box)  # type: ignore[return-value]


def match_given_ids(files: list[Path], given: dict[str, np.ndarray], source: str | Path) -> list[tuple[Path, str]]:
    """(image file, the boxes file's id for it) for every id of `given`: the file whose id is that id, or whose
    stem ends in it as a number (a COCO id and `COCO_train2014_000000000042.jpg`). An id with no file is an error."""
    by_id = {image_id_of(p): p for p in files}
    by_number: dict[str, Path] = {}
    for p in files:
        tail = p.stem.rsplit("_", 1)[-1]
        if tail.isdigit():
            by_number.setdefault(str(int(tail)), p)
    pairs = []
    for image_id in given:
        path = by_id.get(image_id) or (by_number.get(str(int(image_id))) if image_id.isdigit() else None)
        if path is None:
            raise VlbertsError(f"no image file for image id {image_id} of the boxes file", path=source, record=image_id)
        pairs.append((path, image_id))
    return pairs


@torch.no_grad()
def detect_regions(model: torch.nn.Module, images: list[torch.Tensor], selection: SelectionConfig,
                   given: list[np.ndarray] | None = None) -> list[dict[str, np.ndarray]]:
    """Per image (3, H, W): boxes (N, 4) in its pixels, features (N, 1024), cls_prob (N, C) of the kept
    proposals (module docstring), or, with `given` (per image (N, 4) xyxy pixels), of exactly those boxes."""
    device = next(model.parameters()).device
    batch, _ = model.transform([im.to(device) for im in images])  # resized, normalised, padded
    features = model.backbone(batch.tensors)
    if given is None:
        proposals, _ = model.rpn(batch, features)  # per image (K, 4) in resized pixels
    else:  # the given boxes, in the resized image's pixels
        proposals = [torch.from_numpy(b).to(device) * torch.tensor([w1 / im.shape[-1], h1 / im.shape[-2]] * 2, device=device)
                     for b, im, (h1, w1) in zip(given, images, batch.image_sizes)]
    pooled = model.roi_heads.box_roi_pool(features, proposals, batch.image_sizes)
    regions = model.roi_heads.box_head(pooled)  # (sum K, 1024)
    logits, _ = model.roi_heads.box_predictor(regions)
    probs = logits.softmax(-1)
    out, start = [], 0
    for im, props, (h1, w1) in zip(images, proposals, batch.image_sizes):
        k = len(props)
        h0, w0 = im.shape[-2:]
        scale = props.new_tensor([w0 / w1, h0 / h1, w0 / w1, h0 / h1])
        boxes = (props * scale).cpu().numpy().astype(np.float32)  # original pixels
        p = probs[start:start + k].float().cpu().numpy()
        keep = select_boxes(boxes, p, selection) if given is None else np.arange(k)
        if given is not None:
            boxes = given[len(out)]  # exactly as given (the round trip through the resize is not exact)
        out.append({"boxes": boxes[keep], "features": regions[start:start + k][keep].float().cpu().numpy(),
                    "cls_prob": p[keep]})
        start += k
    return out


def extract_folder(
    folder: str | Path,
    weights: str | Path,
    out: str | Path,
    *,
    selection: SelectionConfig = SelectionConfig(),
    settings: DetectorSettings = DetectorSettings(),
    dtype: str = "float32",
    classes: list[str] | str | Path | None = None,
    batch_images: int = 2,
    device: str | torch.device = "cpu",
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    boxes: str | Path | None = None,
) -> Path:
    """Detect and describe the regions of every image in `folder` into a new store at `out` (written
    atomically: an unreadable image leaves none behind). `classes`: the detector's class names (column i
    of cls_prob is class i, background first), saved in the store's metadata. `boxes`: a file of given
    boxes (`read_given_boxes`): its images only, described at exactly those boxes."""
    selection.validate()
    out = Path(out)
    if out.exists() and not overwrite:
        raise VlbertsError("already exists (pass --overwrite to replace it)", path=out)
    given = None if boxes is None else read_given_boxes(boxes)
    pairs = ([(p, image_id_of(p)) for p in image_files(folder)] if given is None
             else match_given_ids(image_files(folder), given, boxes))
    model, arch, num_classes = build_detector(weights, settings)
    model.to(device)
    classes_file = None if classes is None or isinstance(classes, list) else classes  # a file: named in errors
    classes = read_vocab(classes_file) if classes_file is not None else classes
    if classes is not None and len(classes) not in (num_classes, num_classes - 1):
        raise VlbertsError(f"{len(classes)} class names for a detector of {num_classes} classes (with background, "
                           f"or {num_classes - 1} without)", path=classes_file)
    sha = hashlib.sha256(Path(weights).read_bytes()).hexdigest() if Path(weights).is_file() else None
    meta = StoreMetadata(
        extractor=f"torchvision-{arch}", weights_hash=sha,
        settings={"box_policy": selection.policy, "conf_thresh": selection.conf_thresh, "min_boxes": selection.min_boxes,
                  "max_boxes": selection.max_boxes, "nms": selection.nms, "order": selection.order,
                  "feature_layer": "box_head", "background_column": "first", "boxes": "proposals (not class-regressed)",
                  "min_size": settings.min_size, "max_size": settings.max_size, "proposals": settings.proposals}
        if given is None else
        {"box_policy": "given", "boxes": f"given ({Path(boxes).name}, sha256 {_sha256(boxes)[:12]}), in its order",
         "feature_layer": "box_head", "background_column": "first", "min_size": settings.min_size,
         "max_size": settings.max_size},
        classes=None if classes is None else (classes[1:] if len(classes) == num_classes else classes),
    )
    with RegionStoreWriter(out, feature_dim=1024, dtype=dtype, metadata=meta, with_cls_prob=num_classes,
                           with_objects=True) as writer:
        for chunk in _chunks(pairs, batch_images):
            images = [read_image(p) for p, _ in chunk]
            found_all = detect_regions(model, images, selection,
                                       None if given is None else [given[image_id] for _, image_id in chunk])
            for (path, image_id), image, found in zip(chunk, images, found_all):
                n = len(found["boxes"])
                obj = found["cls_prob"][:, 1:]
                try:
                    record = RegionRecord(
                        image_id=image_id, image_w=int(image.shape[-1]), image_h=int(image.shape[-2]),
                        boxes=found["boxes"], features=found["features"], cls_prob=found["cls_prob"],
                        obj_id=obj.argmax(1) if n else np.zeros(0, np.int64), obj_conf=obj.max(1) if n else np.zeros(0),
                    )
                except VlbertsError as e:  # a given box the image cannot hold: the boxes file's record (or the image)
                    raise VlbertsError(e.message, path=boxes if given is not None else path,
                                       record=e.record or image_id) from None
                writer.add(record)
            if progress is not None:
                progress(len(chunk))
    return out


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), max(1, size)):
        yield items[i:i + max(1, size)]
