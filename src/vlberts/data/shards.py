"""Streaming pre-training data from WebDataset-style tar shards (issue 6, item 4).

A corpus the size of Conceptual Captions (3.3M images x 36 x 2048 float16 = 0.5 TB of features) never
fits in memory, and random access into one HDF5 file over a network file system is slow. Shards turn
it into sequential reads: each shard is a plain POSIX tar (written byte for byte as the standard
`tarfile` module writes a ustar archive, without its per-member cost; the layout is the one `webdataset`
reads, so either reader works), and a sample is the run of consecutive members that share a key:

    <key>.json           {"kind", "image_id", "image_w", "image_h", "captions": [...], "fields": [...]}
                         and, for LXMERT's corpus, the image's questions with their answers,
                         "questions": [{"text", "label": {answer: score}}] (LXMERT §3.1.3 image QA)
                         text-only documents: {"kind": "text", "text": ...} and nothing else, with the
                         document's sentences as "sentences": [...] when it was given as sentences
                         (BERT's corpus format; next-sentence prediction needs them)
    <key>.<field>.npy    one per region field of the store, named as `RegionRecord`'s fields:
                         boxes, features (float16 or float32 as stored), cls_prob, obj_id, obj_conf,
                         attr_id, attr_conf

Kinds: "image-text" (an image with its captions), "image" (no captions), "text" (a document).
Shards are `<prefix>-000000.tar`, ..., each written under a temp name and renamed when complete, plus
`<prefix>-index.json` listing every shard and its sample counts. Write them with `write_shards` or

    python -m vlberts.data.shards --store features.h5 --captions captions_train.json --out shards/

`ShardStream` reads a list of shards one after another (one sample in memory at a time, plus the
shuffle buffer); each epoch's shard order is a permutation drawn from (seed, epoch), and (rank, worker)
number g of G = world x workers reads shards g, g + G, ... of it, so every shard is read by exactly one
reader per epoch. `resample=True` draws shards with replacement forever instead (each reader its own
stream), as mixing needs. `mix_streams` interleaves streams by weight (image-text, text-only,
image-only: W-VisualBERT §3 trains on unpaired data of each modality).

A reader sees only its own shards, so what lies across shards (a key or an image id in two of them, a
shard unlike its index entry) is checked by reading the whole set once, `check_shard_set`, or

    python -m vlberts.data.shards --check shards/shard-index.json
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import sys
import tarfile
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from vlberts.data.coco import CaptionRef, read_caption_refs
from vlberts.data.lxmert_corpus import qa_answer_counts
from vlberts.data.regions import Regions, load_regions
from vlberts.data.sampling import epoch_order
from vlberts.data.text_corpus import image_id_lines, read_documents
from vlberts.data.vqa import label_scores
from vlberts.errors import EXIT_BAD_INPUT, VlbertsError
from vlberts.features.record import RegionRecord, StoreMetadata, labels_misfit, record_misfit
from vlberts.features.store import RecordLayout, RegionStore
from vlberts.io import atomic_path, read_json, require_text, write_json
from vlberts.training.distributed import DistInfo

SHARD_FORMAT = "vlberts-shards"
SHARD_FORMAT_VERSION = 1
KINDS = ("image-text", "image", "text")
REGION_FIELDS = ("boxes", "features", "cls_prob", "obj_id", "obj_conf", "attr_id", "attr_conf")
_SAFE_KEY = re.compile(r"[A-Za-z0-9_\-]+")  # WebDataset splits a member name at its first dot
_BLOCK = 512  # a tar block
_RECORD = 20 * _BLOCK  # tar pads an archive to a multiple of this (tarfile's RECORDSIZE, `tar -b20`)
_MAX_KEY = 80  # sample keys in member names (<= 100 bytes: the key, a dot, the longest extension)


# --------------------------------------------------------------------------- writing
_NPY_WRITE_HEADERS: dict[tuple[str, tuple[int, ...]], bytes] = {}  # (dtype, shape) -> header; the reader's cache is below


def _npy_bytes(a: np.ndarray) -> bytes:
    """`a` as `np.save` writes it (format 1.0, C order), with the header of each (dtype, shape) built once:
    numpy builds it anew per call, most of a small array's cost (a sample has seven of them)."""
    a = np.ascontiguousarray(a)
    key = (a.dtype.str, a.shape)
    head = _NPY_WRITE_HEADERS.get(key)
    if head is None:
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(a))
        head = buf.getvalue()
        if len(_NPY_WRITE_HEADERS) < 4096:
            _NPY_WRITE_HEADERS[key] = head
    return head + a.tobytes()


def _tar_header(name: bytes, size: int) -> bytes:
    """The POSIX ustar header of a regular file as `tarfile` writes one with USTAR_FORMAT (mode 644, owner 0,
    mtime 0, no user or group names, so that the same input gives the same bytes), built directly: `tarfile`
    copies a TarInfo and formats each field in Python, about 0.1 ms a member. `name` must fit 100 bytes."""
    head = (name.ljust(100, b"\0") + b"0000644\0" + b"0000000\0" + b"0000000\0" + b"%011o\0" % size
            + b"00000000000\0" + b"        " + b"0").ljust(257, b"\0") + b"ustar\x0000"
    head = head.ljust(_BLOCK, b"\0")
    return head[:148] + b"%06o\0" % sum(head) + head[155:]  # the checksum counts its own field as 8 spaces


def _image_sample(rec: RegionRecord, captions: list[str], arrays: dict[str, np.ndarray],
                  questions: Sequence[dict[str, Any]] = ()) -> dict[str, bytes]:
    """The members (extension -> bytes) of one image: its json and one .npy per region field it holds
    (`arrays`, as `RecordLayout.arrays` gives them). `questions`: {"text", "label"} of each of its questions."""
    meta: dict[str, Any] = {
        "kind": "image-text" if captions or questions else "image", "image_id": rec.image_id, "image_w": rec.image_w,
        "image_h": rec.image_h, "captions": captions, "fields": list(arrays),
    }
    if questions:
        meta["questions"] = list(questions)
    members = {"json": json.dumps(meta).encode()}
    members.update({f"{name}.npy": _npy_bytes(a) for name, a in arrays.items()})
    return members


class _ShardWriter:
    """Appends samples to `<prefix>-NNNNNN.tar`, starting a new shard every `shard_size` samples. Each shard
    is written as `tarfile` writes a USTAR archive (`_tar_header`, data padded to 512-byte blocks, two zero
    blocks at the end and zeros up to a multiple of 10,240 bytes), under a temp name renamed when complete."""

    def __init__(self, out_dir: Path, prefix: str, shard_size: int):
        self.out_dir, self.prefix, self.shard_size = out_dir, prefix, shard_size
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._atomic: Any = None
        self._offset = 0

    def add(self, key: str, members: dict[str, bytes], kind: str) -> None:
        if self._file is None or self.shards[-1]["samples"] >= self.shard_size:
            self._close_shard()
            if not self.shards:
                # Before the first shard of an overwrite replaces the old set's: its index goes, so that an
                # interrupted overwrite leaves no index over a mix of new and old shards (which read as one
                # set, every check passing); a set refused before anything was written keeps its index.
                (self.out_dir / f"{self.prefix}-index.json").unlink(missing_ok=True)
            name = f"{self.prefix}-{len(self.shards):06d}.tar"
            self._atomic = atomic_path(self.out_dir / name)
            self._file = open(self._atomic.__enter__(), "wb")
            self._offset = 0
            self.shards.append({"name": name, "samples": 0, "kinds": dict.fromkeys(KINDS, 0)})
        for ext, data in members.items():
            pad = -len(data) % _BLOCK
            self._file.write(_tar_header(f"{key}.{ext}".encode(), len(data)))
            self._file.write(data)
            self._file.write(bytes(pad))
            self._offset += _BLOCK + len(data) + pad
        self.shards[-1]["samples"] += 1
        self.shards[-1]["kinds"][kind] += 1

    def _close_shard(self) -> None:
        if self._file is not None:
            end = self._offset + 2 * _BLOCK  # two zero blocks end the archive
            self._file.write(bytes(2 * _BLOCK + (-end % _RECORD)))
            self._file.close()
            self._atomic.__exit__(None, None, None)  # os.replace(tmp, shard)
            self._file = self._atomic = None

    def close(self, error: BaseException | None = None) -> None:
        if error is None:
            self._close_shard()
        elif self._file is not None:  # the shard in progress is removed; finished ones stay
            self._file.close()
            self._atomic.__exit__(type(error), error, None)
            self._file = self._atomic = None


def _sample_key(image_id: str, index: int) -> str:
    """The image id, or a numbered key where the id holds other characters or is too long for a member's name
    (a ustar name holds 100 bytes, and ".attr_conf.npy" follows the key)."""
    return image_id if _SAFE_KEY.fullmatch(image_id) and len(image_id) <= _MAX_KEY else f"sample{index:09d}"


def _check_target(out_dir: Path, prefix: str, shard_size: int, overwrite: bool) -> None:
    if shard_size < 1:
        raise VlbertsError(f"shard_size must be >= 1, got {shard_size}")
    if not _SAFE_KEY.fullmatch(prefix):
        raise VlbertsError(f"shard prefix {prefix!r} must be letters, digits, '_' or '-'")
    if (out_dir / f"{prefix}-index.json").exists() and not overwrite:
        raise VlbertsError(f"a shard set {prefix}-* is already there (pass --overwrite to replace it)", path=out_dir)


def _make_dir(out_dir: Path) -> None:
    try:  # here, not in the shard writer: a file at --out would end in a traceback there
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is there" if out_dir.is_file() else e.strerror or e
        raise VlbertsError(f"cannot make the output directory ({why})", path=out_dir) from None


def _store_entry(path: str | None, layout: RecordLayout, metadata: StoreMetadata) -> dict[str, Any]:
    """What the index says of the regions' source: the store's path (None when records were imported straight
    into shards), feature width, dtype, fields and metadata (`index_store` reads it back)."""
    fields = [name for name, _, _ in layout.box_fields()]
    return {"path": path, "feature_dim": layout.feature_dim, "dtype": layout.dtype, "fields": fields,
            "metadata": metadata.to_dict()}


def _finish_set(out_dir: Path, prefix: str, writer: "_ShardWriter", extra: dict[str, Any]) -> Path:
    """The index json of a written shard set (`extra`'s entries before the shard list); an older set of the
    same prefix loses its shards beyond the new ones. Returns the index's path."""
    if not writer.shards:
        raise VlbertsError("nothing to write (no captioned images, images or documents)", path=out_dir)
    index_path = out_dir / f"{prefix}-index.json"
    write_json(index_path, {
        "format": SHARD_FORMAT, "format_version": SHARD_FORMAT_VERSION,
        "samples": sum(s["samples"] for s in writer.shards),
        "kinds": {k: sum(s["kinds"][k] for s in writer.shards) for k in KINDS},
        **extra,
        "shards": writer.shards,
    })
    # An overwritten set of more shards leaves its later ones behind; a reader that globs <prefix>-*.tar
    # (WebDataset's usual brace or glob pattern) would read them with the new ones.
    written = {s["name"] for s in writer.shards}
    for stale in out_dir.glob(f"{prefix}-*.tar"):
        if re.fullmatch(rf"{re.escape(prefix)}-\d{{6}}\.tar", stale.name) and stale.name not in written:
            stale.unlink(missing_ok=True)
    return index_path


class ShardSetWriter:
    """Region records, each with its captions, written straight into a shard set laid out as `write_shards`
    lays out a store's: for an import whose source is too large to keep twice (`vlberts features import
    --shards`, e.g. ViLBERT's Conceptual Captions LMDB). Every record must fit `layout`
    (`RecordLayout.arrays`); an image with captions is an "image-text" sample, one without an "image"
    sample. The index's `store` entry has no path, and `metadata` as it is at close (an importer adds the
    source's hash at the end). On an error (`abort`, or an exception leaving the `with` block) the shard in
    progress is removed; the finished ones stay, and no index is written."""

    def __init__(self, out_dir: str | Path, layout: RecordLayout, metadata: StoreMetadata, *, shard_size: int = 1000,
                 prefix: str = "shard", overwrite: bool = False):
        self.out_dir, self.layout, self.metadata, self.prefix = Path(out_dir), layout, metadata, prefix
        _check_target(self.out_dir, prefix, shard_size, overwrite)
        _make_dir(self.out_dir)
        self._writer = _ShardWriter(self.out_dir, prefix, shard_size)
        self._n = 0

    def add(self, rec: RegionRecord, captions: Sequence[str] = ()) -> None:
        arrays = self.layout.arrays(rec, self.metadata, path=self.out_dir, holder="shard set")
        self._writer.add(_sample_key(rec.image_id, self._n), _image_sample(rec, list(captions), arrays),
                         "image-text" if captions else "image")
        self._n += 1

    def close(self) -> Path:
        """Finish the last shard and write the index; returns the index json's path."""
        self._writer.close()
        return _finish_set(self.out_dir, self.prefix, self._writer, {
            "images_without_captions_skipped": 0, "store": _store_entry(None, self.layout, self.metadata)})

    def abort(self, error: BaseException) -> None:
        self._writer.close(error)

    def __enter__(self) -> "ShardSetWriter":
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if error is None:
            self.close()
        else:
            self.abort(error)


def write_shards(
    store: RegionStore | str | Path | None,
    captions: Sequence[CaptionRef] | str | Path | None,
    out_dir: str | Path,
    *,
    shard_size: int = 1000,
    prefix: str = "shard",
    image_only: bool = False,
    withhold: Collection[str] | str | Path = (),
    documents: Iterable[str | Sequence[str]] = (),
    overwrite: bool = False,
    questions: Sequence[tuple[CaptionRef, dict[str, float]]] = (),
) -> Path:
    """Pack a region store and its captions (and optionally text-only documents) into tar shards.

    store: a `RegionStore` or its path (None: text-only shards). Features are written in the store's
        dtype, so arrays read back are bit-identical to the store's.
    captions: `CaptionRef`s or a caption file (`read_caption_refs`); None writes every image as an
        image-only sample. A caption of an image the store lacks is an error.
    image_only: also write the store's images that have no caption, as "image" samples (otherwise they
        are left out: a Karpathy split's captions name only that split's images).
    withhold: image ids whose captions are left out and which are written as "image" samples (H-VisualBERT's
        image-only set, W-VisualBERT §4.3: the world's unpaired_images.txt), or a file of them, one per line
        (`data.text_corpus.read_image_ids`); each must be in the store (an id it lacks: an error naming the
        file and the id's line).
    documents: text-only samples, written after the images: each a text, or a list of sentences
        (`data.text_corpus.read_documents`), stored as "sentences" beside their joined "text".
    overwrite: replace a shard set of the same prefix in `out_dir`, its shards beyond the new ones removed
        (otherwise an error).
    questions: LXMERT's image-QA questions, (image and question, {answer: score}): written with their image
        (its "questions"), and the index counts each (converted) best answer, "qa_answer_counts", from which a
        streamed run counts the joint answer table as a run reading the corpus file does.
    Returns the index json `<out_dir>/<prefix>-index.json`.
    """
    out_dir = Path(out_dir)
    _check_target(out_dir, prefix, shard_size, overwrite)
    if isinstance(store, (str, Path)):
        store = RegionStore(store, upcast=False)
    refs = read_caption_refs(captions) if isinstance(captions, (str, Path)) else captions
    withhold_file = Path(withhold) if isinstance(withhold, (str, Path)) else None
    lines = image_id_lines(withhold_file) if withhold_file is not None else {}
    withheld = set(lines) if withhold_file is not None else {str(i) for i in withhold}
    # Texts by the id the store holds their image under (a COCO image has two names: LXMERT's corpus uses the
    # file stem, a store may hold the number); a name the store lacks stays as given, for the error below.
    stored = (lambda i: store.stored_id(i) or i) if isinstance(store, RegionStore) else (lambda i: i)
    by_image: dict[str, list[str]] = {}
    for ref in refs or ():
        if ref.image_id not in withheld:
            by_image.setdefault(stored(ref.image_id), []).append(ref.text)
    asked: dict[str, list[dict[str, Any]]] = {}
    for ref, label in questions:
        if ref.image_id not in withheld:
            asked.setdefault(stored(ref.image_id), []).append({"text": ref.text, "label": label})
            by_image.setdefault(stored(ref.image_id), [])
    if by_image and store is None:
        raise VlbertsError("captions given without a region store")
    if withheld and store is None:
        raise VlbertsError("images to withhold given without a region store")
    for what, ids in (("captioned image", by_image), ("withheld image", sorted(withheld))):
        missing = [i for i in ids if i not in store] if store is not None else []
        if missing and what == "withheld image" and withhold_file is not None:
            first = min(missing, key=lines.__getitem__)
            raise VlbertsError(f"image id {first} is not in the store {store.path} ({len(missing)} withheld id(s) "
                               "missing from it)", path=withhold_file, record=f"line {lines[first]}")
        if missing:
            raise VlbertsError(f"{len(missing)} {what}(s) are not in the store", path=store.path, record=missing[0])

    _make_dir(out_dir)
    layout = store.layout if store is not None else None
    writer = _ShardWriter(out_dir, prefix, shard_size)
    index, skipped = 0, 0
    try:
        for rec in store.records() if store is not None else ():
            caps, asks = by_image.get(rec.image_id, []), asked.get(rec.image_id, [])
            if (refs is not None or questions) and not caps + asks and not image_only and rec.image_id not in withheld:
                skipped += 1
                continue
            sample = _image_sample(rec, caps, layout.arrays(rec, store.metadata, path=store.path), asks)
            writer.add(_sample_key(rec.image_id, index), sample, "image-text" if caps or asks else "image")
            index += 1
        for k, doc in enumerate(documents):
            meta = {"kind": "text", "text": doc} if isinstance(doc, str) else {
                "kind": "text", "text": " ".join(doc), "sentences": list(doc)}
            _check_meta(meta, f"document {k}", shard=out_dir, record=f"document {k}")
            writer.add(f"doc{k:09d}", {"json": json.dumps(meta).encode()}, "text")
            index += 1
    except BaseException as e:
        writer.close(e)
        raise
    writer.close()
    extra: dict[str, Any] = {"images_without_captions_skipped": skipped}
    if questions:
        written = [q["label"] for asks in asked.values() for q in asks]
        extra.update(questions=len(written), qa_answer_counts=dict(qa_answer_counts(written).most_common()))
    return _finish_set(out_dir, prefix, writer, {
        **extra, "store": None if store is None else _store_entry(str(store.path), layout, store.metadata),
    })


def read_index(index: Path) -> dict[str, Any]:
    """A shard set's index json, with what readers take from it checked: its format, a list of shards
    each with a file name (at least one), the store's feature width and fields when it names a store, and
    its sample counts by kind as whole numbers (`kinds`, returned with every kind present)."""
    obj = read_json(index)
    if not isinstance(obj, dict) or obj.get("format") != SHARD_FORMAT:
        raise VlbertsError(f"not a {SHARD_FORMAT} index (no format={SHARD_FORMAT!r})", path=index)
    shards = obj.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in shards):
        raise VlbertsError("the index's shards must be a list of {name, samples, kinds}", path=index)
    if not shards:  # write_shards never writes one; streaming it would fail later without naming the index
        raise VlbertsError("the index's shard list is empty", path=index)
    store = obj.get("store")
    if store and not (isinstance(store, dict) and isinstance(store.get("feature_dim"), int)
                      and isinstance(store.get("fields"), list)):
        raise VlbertsError("the index's store must give feature_dim and fields", path=index)
    obj["kinds"] = _kinds_of(obj, index)  # pre-training sizes its streams from these totals
    return obj


def shards_of_index(index: str | Path) -> list[Path]:
    """The shard files an index json lists (next to it); a missing shard is an error naming it."""
    index = Path(index)
    paths = [index.parent / s["name"] for s in read_index(index)["shards"]]
    for p in paths:
        if not p.is_file():
            raise VlbertsError("shard listed in the index is missing", path=p)
    return paths


# --------------------------------------------------------------------------- reading
# .npy headers already parsed: header bytes -> (shape, Fortran order, dtype, data offset). A shard set's
# arrays have a handful of distinct headers (36 x 2048 float16 features, 36 x 4 boxes, ...), and numpy's
# parser (ast.literal_eval of the header) was a sixth of a sample's decoding time.
_NPY_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype, int]] = {}


def _npy_header(data: bytearray) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran, dtype, offset of the data) of a .npy member, parsed by numpy once per distinct header."""
    size = 2 if data[6:7] == b"\x01" else 4  # the header length field: 2 bytes in format 1.0, 4 after
    end = 8 + size + int.from_bytes(data[8 : 8 + size], "little") if len(data) >= 8 + size else 0
    key = bytes(data[:end])
    parsed = _NPY_HEADERS.get(key) if end else None
    if parsed is None:
        f = io.BytesIO(data)
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        parsed = (shape, fortran, dtype, f.tell())
        if f.tell() == end and len(_NPY_HEADERS) < 1024:
            _NPY_HEADERS[key] = parsed
    return parsed


def _load_npy(data: bytearray) -> np.ndarray:
    """A .npy member as an array viewing `data` (np.load would copy it; that copy was a fifth of the
    decoding time of a 36 x 2048 float16 sample). Object arrays are refused, as np.load(allow_pickle=False) does."""
    shape, fortran, dtype, offset = _npy_header(data)
    if dtype.hasobject:
        raise ValueError("object arrays are not allowed")
    a = np.frombuffer(data, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)), offset=offset)
    return a.reshape(shape, order="F" if fortran else "C")


def _check_meta(meta: dict[str, Any], name: str, *, shard: Path, record: str) -> None:
    """What each kind's json must hold (what `write_shards` writes): the text a model reads is never blank."""
    need = {"image-text": ("image_id", "image_w", "image_h", "captions"), "image": ("image_id", "image_w", "image_h"),
            "text": ("text",)}[meta["kind"]]
    missing = [k for k in need if k not in meta]
    if missing:
        raise VlbertsError(f"{name} ({meta['kind']}) has no {', '.join(missing)}", path=shard, record=record)
    if meta["kind"] == "text":
        require_text(meta["text"], "text", path=shard, record=record)
        sentences = meta.get("sentences", [meta["text"]])
        if not isinstance(sentences, list) or not sentences:
            raise VlbertsError(f"{name}: sentences must be a non-empty list", path=shard, record=record)
        for j, sentence in enumerate(sentences):
            require_text(sentence, f"sentences[{j}]", path=shard, record=record)
    if meta["kind"] == "image-text":
        captions, questions = meta["captions"], meta.get("questions", [])
        if not isinstance(captions, list) or not isinstance(questions, list) or not captions + questions:
            raise VlbertsError(f"{name}: captions (or questions) must be a non-empty list", path=shard, record=record)
        for j, caption in enumerate(captions):
            require_text(caption, f"captions[{j}]", path=shard, record=record)
        for j, question in enumerate(questions):
            if not isinstance(question, dict) or "text" not in question or "label" not in question:
                raise VlbertsError(f"{name}: questions[{j}] must be an object with text and label", path=shard,
                                   record=record)
            require_text(question["text"], f"questions[{j}].text", path=shard, record=record)
            label_scores(question["label"], path=shard, record=f"{record} questions[{j}]")
    if not isinstance(meta.get("fields", []), list):
        raise VlbertsError(f"{name}: fields must be a list of region field names", path=shard, record=record)


def _decode(shard: Path, key: str, members: dict[str, bytearray | tuple[int, int]]) -> dict[str, Any]:
    """One sample's members -> a dict of the json's entries and the region arrays by field name. A member
    given as (offset, size) instead of its bytes is left unread: the sample then holds `__arrays__`,
    {field: (offset, size)} in the shard, for `load_arrays` (`read_shard(arrays=False)`)."""
    if "json" not in members:
        raise VlbertsError(f"sample has no {key}.json member", path=shard, record=f"key {key}")
    try:
        meta = json.loads(members["json"])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VlbertsError(f"{key}.json is not valid JSON ({e})", path=shard, record=f"key {key}") from None
    if not isinstance(meta, dict) or meta.get("kind") not in KINDS:
        raise VlbertsError(f"{key}.json has no kind in {', '.join(KINDS)}", path=shard, record=f"key {key}")
    _check_meta(meta, f"{key}.json", shard=shard, record=f"key {key}")
    sample: dict[str, Any] = {"__key__": key, "__shard__": shard.name, "__path__": str(shard), **meta}
    unread: dict[str, tuple[int, int]] = {}
    for field in meta.get("fields", []):
        data = members.get(f"{field}.npy")
        if data is None:
            raise VlbertsError(f"sample has no {key}.{field}.npy member", path=shard, record=f"key {key}")
        if isinstance(data, tuple):
            unread[field] = data
        else:
            sample[field] = _array(data, shard, key, field)
    if unread:
        sample["__arrays__"] = unread
    return sample


def _array(data: bytearray, shard: Path, key: str, field: str) -> np.ndarray:
    try:
        return _load_npy(data)
    except (ValueError, OSError, EOFError) as e:
        raise VlbertsError(f"{key}.{field}.npy is not a readable .npy ({e})", path=shard, record=f"key {key}") from None


def load_arrays(sample: dict[str, Any]) -> dict[str, Any]:
    """A sample read with `read_shard(arrays=False)` with its region arrays read from its shard (one
    open, a seek and a read per field); a sample that holds its arrays already is returned as it is."""
    unread = sample.get("__arrays__")
    if not unread:
        return sample
    shard, key = Path(sample["__path__"]), sample["__key__"]
    out = {k: v for k, v in sample.items() if k != "__arrays__"}
    try:
        with open(shard, "rb") as f:
            for field, (offset, size) in unread.items():
                f.seek(offset)
                data = bytearray(size)  # writable, so arrays viewing it are too
                if f.readinto(data) != size:
                    raise VlbertsError(f"{key}.{field}.npy is cut short (the shard changed since it was read?)",
                                       path=shard, record=f"key {key}")
                out[field] = _array(data, shard, key, field)
    except OSError as e:
        raise VlbertsError(f"cannot read shard ({e.strerror or e})", path=shard, record=f"key {key}") from None
    return out


_ZERO_BLOCK = bytes(_BLOCK)


def _header(block: bytes) -> tuple[str, int, bool] | None:
    """(name, data size, is a regular file) of a tar header block of the plain kinds a shard writer makes
    (POSIX ustar, GNU or v7; a regular file or a directory, octal size, right checksum), else None."""
    typeflag = block[156:157]
    if typeflag not in (b"0", b"\0", b"5"):
        return None
    try:
        size = int(block[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
        checksum = int(block[148:156].split(b"\0", 1)[0].strip(), 8)
    except ValueError:  # base-256 numbers, damage: tarfile decides
        return None
    if checksum != sum(block[:148]) + 256 + sum(block[156:]):  # the checksum field counts as 8 spaces
        return None
    name = block[:100].split(b"\0", 1)[0]
    if block[257:265] == b"ustar\x0000":  # POSIX: a long name is split into prefix / name
        prefix = block[345:500].split(b"\0", 1)[0]
        name = prefix + b"/" + name if prefix else name
    # As tarfile reads them: v7 marks a directory by a trailing slash on a file of type NUL.
    regular = typeflag == b"0" or (typeflag == b"\0" and not name.endswith(b"/"))
    return name.decode("utf-8", "surrogateescape"), size, regular


def _tar_files(f: io.BufferedReader, total: int) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, size) of each regular file of the tar `f` (`total` bytes), in file order.

    A shard's headers are read here directly: tarfile's own parsing of a header (a TarInfo with every
    field decoded) was a fifth of what a streamed sample cost. From the first header of another kind
    (pax or GNU long-name records, links, sparse files, base-256 numbers, a bad checksum: e.g. shards
    written by other tools) tarfile reads the rest. The caller may move `f` between members. A tar cut
    inside a header, ending without its end-of-archive blocks or holding a header that is not one (where
    tarfile alone would stop quietly, as at the end) raises `tarfile.ReadError`."""
    def end_at(pos: int) -> None:  # the archive must end here: two zero blocks (tarfile stops at the first)
        f.seek(pos)
        if total - pos < 2 * _BLOCK:
            raise tarfile.ReadError("no end-of-archive blocks")
        if f.read(_BLOCK) != _ZERO_BLOCK:
            raise tarfile.ReadError(f"a damaged header at byte {pos} (bad checksum or not a tar header)")

    pos = 0
    while True:
        f.seek(pos)
        block = f.read(_BLOCK)
        if block == _ZERO_BLOCK:
            return end_at(pos)
        header = _header(block) if len(block) == _BLOCK else None
        if header is None:
            if len(block) < _BLOCK:
                raise tarfile.ReadError("a header cut short" if block else "no end-of-archive blocks")
            f.seek(pos)
            with tarfile.open(fileobj=f, mode="r:") as tar:  # reads on from `pos`: offsets stay the file's
                for info in tar:
                    if info.isfile():
                        yield info.name, info.offset_data, info.size
                end = tar.offset  # tarfile stops quietly at a header cut short or damaged past the first
            return end_at(end)
        name, size, regular = header
        if regular:
            yield name, pos + _BLOCK, size
        pos += _BLOCK + -(-size // _BLOCK) * _BLOCK


def read_shard(shard: str | Path, *, arrays: bool = True,
               select: Callable[[int], bool] | None = None) -> Iterator[dict[str, Any]]:
    """Decoded samples of one shard in file order, reading one member at a time.

    arrays=False reads each sample's json only and steps over its .npy members (the tar headers give
    their offsets): the sample names them in `__arrays__`, and `load_arrays` reads them when they are
    needed, e.g. for the chunks a pre-training stream builds, not for every sample it draws.
    select: which samples to decode, by number in the shard (0, 1, ...); the others' members are stepped
    over unread, as a resumed `ShardReader` steps over the samples it had read.

    A member without its sample's other members, an unreadable member, or a tar that ends early (cut
    inside a member or without its end-of-archive blocks) is a one-line `VlbertsError` naming the shard
    and the sample key (an unreadable .npy left unread: when `load_arrays` reads it).
    """
    shard = Path(shard)
    key: str | None = None
    members: dict[str, bytearray | tuple[int, int]] = {}
    seen: set[str] = set()
    wanted = True  # whether the sample being read is decoded (`select`)
    try:
        size = shard.stat().st_size
        with open(shard, "rb") as f:
            for name, offset, length in _tar_files(f, size):
                base = name.rsplit("/", 1)[-1]
                k, dot, ext = base.partition(".")
                if not dot:
                    raise VlbertsError(f"member {name} has no extension", path=shard, record=f"key {k}")
                if k != key:
                    if key is not None and wanted:
                        yield _decode(shard, key, members)
                    if k in seen:  # a writer puts a sample's members together, once
                        raise VlbertsError(f"sample key {k} appears twice in the shard", path=shard, record=f"key {k}")
                    wanted = select is None or select(len(seen))
                    seen.add(k)
                    key, members = k, {}
                if ext in members:
                    raise VlbertsError(f"member {name} appears twice", path=shard, record=f"key {k}")
                if not wanted or (not arrays and ext.endswith(".npy")):
                    members[ext] = (offset, length)  # stepped over
                    continue
                data = bytearray(length)  # writable, so arrays viewing it are too
                f.seek(offset)
                if f.readinto(data) != length:
                    raise tarfile.ReadError("a member cut short")
                members[ext] = data
    except tarfile.TarError as e:
        raise VlbertsError(f"unreadable tar ({e}), truncated or damaged", path=shard,
                           record=f"key {key}" if key is not None else None) from None
    except OSError as e:
        raise VlbertsError(f"cannot read shard ({e.strerror or e})", path=shard) from None
    if key is not None and wanted:
        yield _decode(shard, key, members)


def document_sentences(sample: dict[str, Any]) -> list[str]:
    """A text sample's sentences: those it was written with, else its text as one sentence."""
    return list(sample.get("sentences") or [sample["text"]])


def sample_record(sample: dict[str, Any]) -> RegionRecord:
    """The `RegionRecord` of an image sample, validated as any record is; an error names the shard and key."""
    fields = {name: sample[name] for name in REGION_FIELDS if name in sample}
    try:
        return RegionRecord(image_id=sample["image_id"], image_w=sample["image_w"], image_h=sample["image_h"],
                            **fields)
    except VlbertsError as e:
        raise _sample_error(sample, e.message) from None


def _sample_error(sample: dict[str, Any], message: str) -> VlbertsError:
    return VlbertsError(message, path=sample.get("__path__", sample.get("__shard__")), record=f"key {sample.get('__key__')}")


def check_sample_record(sample: dict[str, Any], rec: RegionRecord, *, feature_dim: int, fields: Sequence[str],
                        cls_prob_width: int | None, classes: list[str] | None,
                        attributes: list[str] | None, head_sizes: Mapping[str, int] | None = None) -> RegionRecord:
    """A sample's record against the corpus its index describes, as a region store's fixed dataset shapes
    and metadata hold its records (`record_misfit`): every field the index lists, the feature width, the
    cls_prob width (read off the first sample: the index does not state it), the class and attribute ids;
    and, given `head_sizes` (obj_id / attr_id -> a model head's classes), the ids against the model."""
    missing = [f for f in fields if getattr(rec, f, None) is None]
    if missing:
        raise _sample_error(sample, f"has no {', '.join(missing)}, which the index lists for every sample")
    if rec.features.shape[1] != feature_dim:
        raise _sample_error(sample, f"features are {rec.features.shape[1]}-d, the index says {feature_dim}")
    misfit = record_misfit(rec, cls_prob_width=cls_prob_width, classes=classes, attributes=attributes,
                           holder="shard set")
    if misfit:
        raise _sample_error(sample, misfit)
    head = labels_misfit({"obj_id": rec.obj_id, "attr_id": rec.attr_id}, dict(head_sizes or {}), holder="model head")
    if head:
        raise _sample_error(sample, head[0])
    return rec


class _OneRecord:
    def __init__(self, rec: RegionRecord):
        self.rec = rec

    def get(self, image_id: str) -> RegionRecord:
        return self.rec


def sample_regions(sample: dict[str, Any], max_regions: int, feature_dim: int | None = None) -> Regions:
    """An image sample's first `max_regions` regions as model inputs (`data.regions.load_regions`)."""
    return load_regions(_OneRecord(sample_record(sample)), sample["image_id"], max_regions, feature_dim)


def current_dist() -> DistInfo:
    """Rank and world of this process: the joined process group, else torchrun's RANK/WORLD_SIZE, else 0 of 1."""
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size())
    return DistInfo(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))


def _reader() -> tuple[int, int]:
    """(worker id, number of workers) of the DataLoader worker running this (0 of 1 in the main process)."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def split_shards(
    n: int, *, rank: int, world: int, worker: int, num_workers: int, seed: int, epoch: int, shuffle: bool = True
) -> list[int]:
    """Indices of the shards reader (rank, worker) reads in `epoch`: the epoch's permutation of the n
    shards (`data.sampling.epoch_order`), every G-th from position g, with g = rank * num_workers + worker
    and G = world * num_workers. The readers' lists partition range(n); with n < G some get none, and
    with n not a multiple of G some read one shard more (use >= G shards of similar size, or resample)."""
    if not (0 <= rank < world and 0 <= worker < num_workers):
        raise VlbertsError(f"reader (rank {rank} of {world}, worker {worker} of {num_workers}) is out of range")
    g, G = rank * num_workers + worker, world * num_workers
    return [int(i) for i in epoch_order(n, seed, epoch, shuffle)[g::G]]


class ShardStream(IterableDataset):
    """Samples of a list of shards, split across ranks and DataLoader workers (module docstring).

    shards: the shard files, or one path: a shard set's index json (its shards, `shards_of_index`) or one
        shard `.tar`.

    seed, epoch: the shard order and the shuffle buffer draw from (seed, epoch, rank, worker); call
        `set_epoch` before each epoch (workers receive a copy of this object when they start).
    buffer: samples held for shuffling (0 or 1: file order; memory is `buffer` samples).
    resample: draw shards with replacement forever, each reader from its own (seed, epoch, rank, worker)
        stream, instead of one pass over its split.
    dist: rank and world (default `current_dist()`, read when iterated).
    kinds: keep only samples of these kinds (None: all).
    arrays: False reads each sample's json only; `load_arrays` reads its region arrays (`read_shard`).
    reader: (reader id, readers) to draw as, instead of the DataLoader worker running this (a stream that
        moves between workers keeps its draws: `data.pretrain_stream.worker_batches`).
    Samples are dicts: `__key__`, `__shard__`, the json's entries (kind, image_id, image_w, image_h,
    captions / text) and the region arrays under `RegionRecord`'s field names (`sample_record`).
    """

    def __init__(
        self,
        shards: Sequence[str | Path] | str | Path,
        *,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        buffer: int = 1000,
        resample: bool = False,
        dist: DistInfo | None = None,
        kinds: Sequence[str] | None = None,
        arrays: bool = True,
        reader: tuple[int, int] | None = None,
    ):
        if isinstance(shards, (str, Path)):  # a string is one path, never a sequence of one-letter shards
            shards = shards_of_index(shards) if Path(shards).suffix == ".json" else [shards]
        if not shards:
            raise VlbertsError("no shards to stream")
        unknown = [k for k in kinds or () if k not in KINDS]
        if unknown:
            raise VlbertsError(f"unknown sample kind(s) {', '.join(unknown)}; valid: {', '.join(KINDS)}")
        self.shards = [Path(s) for s in shards]
        self.seed, self.epoch, self.shuffle, self.buffer = seed, epoch, shuffle, buffer
        self.resample, self.dist, self.kinds = resample, dist, None if kinds is None else tuple(kinds)
        self.arrays, self.reader = arrays, reader

    @classmethod
    def from_index(cls, index: str | Path, **kw: Any) -> ShardStream:
        return cls(shards_of_index(index), **kw)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def reader_shards(self) -> Iterator[Path]:
        """The shards this (rank, worker) reads this epoch, in order (endless when resampling)."""
        reader = ShardReader(self)
        while True:
            try:
                shard = reader._draw_shard()
            except StopIteration:
                return
            yield self.shards[shard]

    def __iter__(self) -> ShardReader:
        return ShardReader(self)

    def resume(self, state: Mapping[str, Any]) -> ShardReader:
        """This stream's reader continued from `ShardReader.state()`, as if it had never stopped."""
        return ShardReader(self, state)


class ShardReader(Iterator[dict[str, Any]]):
    """What iterating a `ShardStream` gives: one reader's samples, whose place can be saved at any point
    (`state()`, JSON) and continued from (`ShardStream.resume`) without reading what came before it.

    The place is the shard order's RNG (resampling) or the position in the epoch's shard list, the shard
    being read and how many of its samples were read, and the shuffle buffer: its RNG and the samples it
    holds, as (shard, sample number) references. Continuing reads those samples again (their json, and
    their arrays if the stream reads them) and steps over the read samples of the current shard, so a
    pre-training run resumed after a million samples reads about a buffer's worth, not a million
    (`data.pretrain_stream`). The draws are those of an unbroken reader: shards from (seed, epoch, rank,
    worker), the buffer's from its own such RNG.
    """

    def __init__(self, stream: ShardStream, state: Mapping[str, Any] | None = None):
        d = stream.dist or current_dist()
        worker, workers = stream.reader or _reader()
        self.stream = stream
        self._order: list[int] | None = None  # one epoch's shards (no resampling), read from _next on
        self._shard_rng: np.random.Generator | None = None  # resampling: the shard drawn next
        if stream.resample:
            self._shard_rng = np.random.default_rng([stream.seed, stream.epoch, d.rank, worker, 0x2E5])
        else:
            self._order = split_shards(len(stream.shards), rank=d.rank, world=d.world, worker=worker,
                                       num_workers=workers, seed=stream.seed, epoch=stream.epoch, shuffle=stream.shuffle)
        self._next = 0
        self._shard: int | None = None  # the shard being read (index into stream.shards), None between shards
        self._read = 0  # its samples read, of any kind
        self._samples: Iterator[dict[str, Any]] | None = None
        self._found = False  # a sample of the wanted kinds in the current shard
        self._empty = 0  # shards in a row without one
        shuffled = stream.shuffle and stream.buffer > 1
        self._buf_rng = (np.random.default_rng([stream.seed, stream.epoch, d.rank, worker, 0x5B0])
                         if shuffled else None)
        self._buf: list[tuple[dict[str, Any], tuple[int, int]]] = []  # (sample, (shard, number in it))
        self._drain: list[tuple[dict[str, Any], tuple[int, int]]] | None = None  # the buffer's last, reversed
        if state is not None:
            self._restore(state)

    def __next__(self) -> dict[str, Any]:
        if self._buf_rng is None:  # file order
            return self._next_read()[0]
        while self._drain is None:
            try:
                item = self._next_read()
            except StopIteration:  # the pass is over: the buffer's samples in a random order
                self._drain = [self._buf[i] for i in self._buf_rng.permutation(len(self._buf))][::-1]
                self._buf = []
                break
            if len(self._buf) < self.stream.buffer:
                self._buf.append(item)
                continue
            i = int(self._buf_rng.integers(self.stream.buffer))  # yield a random held sample, hold the new one
            self._buf[i], item = item, self._buf[i]
            return item[0]
        if not self._drain:
            raise StopIteration
        return self._drain.pop()[0]

    def _next_read(self) -> tuple[dict[str, Any], tuple[int, int]]:
        """The next sample of the wanted kinds in shard order, with its reference."""
        stream = self.stream
        while True:
            if self._samples is None:
                self._open(self._draw_shard(), 0)
            assert self._samples is not None and self._shard is not None
            for sample in self._samples:
                number = self._read
                self._read += 1
                if stream.kinds is None or sample["kind"] in stream.kinds:
                    self._found = True
                    return sample, (self._shard, number)
            self._samples = None
            self._empty = 0 if self._found else self._empty + 1
            # Resampling never ends by itself: a set with no sample of the wanted kinds would draw shards
            # forever. 50 x the shard count of empty draws in a row has a chance of e^-50 when one shard has one.
            if stream.resample and self._empty > 50 * len(stream.shards):
                raise VlbertsError(f"{self._empty} shards drawn in a row hold no "
                                   f"{' or '.join(stream.kinds or KINDS)} sample, of {len(stream.shards)} shards",
                                   path=stream.shards[self._shard].parent)

    def _draw_shard(self) -> int:
        if self._shard_rng is not None:
            return int(self._shard_rng.integers(len(self.stream.shards)))
        assert self._order is not None
        if self._next >= len(self._order):
            raise StopIteration
        self._next += 1
        return self._order[self._next - 1]

    def _open(self, shard: int, read: int) -> None:
        """Read shard `shard` on from sample `read`."""
        self._shard, self._read, self._found = shard, read, False
        self._samples = read_shard(self.stream.shards[shard], arrays=self.stream.arrays,
                                   select=(lambda k: k >= read) if read else None)

    def state(self) -> dict[str, Any]:
        """Where this reader stands (the class docstring), as JSON-able values."""
        return {
            "shards": len(self.stream.shards),
            "shard_rng": None if self._shard_rng is None else self._shard_rng.bit_generator.state,
            "next": self._next, "shard": None if self._samples is None else self._shard, "read": self._read,
            "found": self._found, "empty": self._empty,
            "buffer_rng": None if self._buf_rng is None else self._buf_rng.bit_generator.state,
            "buffer": _refs_text(ref for _, ref in self._buf),
            "drain": None if self._drain is None else _refs_text(ref for _, ref in self._drain),
        }

    def _restore(self, state: Mapping[str, Any]) -> None:
        stream = self.stream
        if state.get("shards") != len(stream.shards) or (state.get("shard_rng") is None) != (self._shard_rng is None):
            def kind(n: Any, resampled: bool) -> str:
                return f"{n} shards{' drawn with replacement' if resampled else ''}"

            raise VlbertsError(f"a saved stream position of {kind(state.get('shards'), state.get('shard_rng') is not None)} "
                               f"cannot continue a stream of {kind(len(stream.shards), stream.resample)}",
                               path=stream.shards[0].parent)
        if self._shard_rng is not None:
            self._shard_rng.bit_generator.state = state["shard_rng"]
        if self._buf_rng is not None and state.get("buffer_rng") is not None:
            self._buf_rng.bit_generator.state = state["buffer_rng"]
        self._next, self._empty = int(state["next"]), int(state["empty"])
        self._buf = self._fetch(_refs_of(state["buffer"]))
        self._drain = None if state.get("drain") is None else self._fetch(_refs_of(state["drain"]))
        if state.get("shard") is not None:
            self._open(int(state["shard"]), int(state["read"]))
            self._found = bool(state["found"])

    def _fetch(self, refs: Sequence[tuple[int, int]]) -> list[tuple[dict[str, Any], tuple[int, int]]]:
        """The samples `refs` name, read again (each shard once, up to its last sample named)."""
        by_shard: dict[int, set[int]] = {}
        for shard, number in refs:
            if not 0 <= shard < len(self.stream.shards):
                raise VlbertsError(f"a saved stream position names shard {shard} of {len(self.stream.shards)}",
                                   path=self.stream.shards[0].parent)
            by_shard.setdefault(shard, set()).add(number)
        found: dict[tuple[int, int], dict[str, Any]] = {}
        for shard, numbers in by_shard.items():
            path, wanted = self.stream.shards[shard], sorted(numbers)
            samples = zip(wanted, read_shard(path, arrays=self.stream.arrays, select=numbers.__contains__))
            found.update(((shard, number), sample) for number, sample in samples)  # stops at the last one named
            got = sum(1 for number in wanted if (shard, number) in found)
            if got < len(wanted):
                raise VlbertsError(f"holds {got} of the {len(wanted)} samples a saved stream position names from it "
                                   "(the shard changed since it was saved?)", path=path)
        return [(found[ref], ref) for ref in refs]


def _refs_text(refs: Iterable[tuple[int, int]]) -> str:
    """(shard, sample number) references as "shard:number ..." (a checkpoint's state.json stays small)."""
    return " ".join(f"{shard}:{number}" for shard, number in refs)


def _refs_of(text: str) -> list[tuple[int, int]]:
    """`_refs_text`'s references again."""
    try:
        return [(int(shard), int(number)) for shard, number in (ref.split(":") for ref in text.split())]
    except (ValueError, AttributeError):
        raise VlbertsError(f"a saved stream position's sample references are not shard:number pairs: {str(text)[:40]!r}") from None


class MixedStream(IterableDataset):
    """`mix_streams`' result: an iterable dataset, so that it can run inside DataLoader workers (each
    worker mixes the streams' share of that worker)."""

    def __init__(self, streams: Sequence[Iterable[Any]], weights: Sequence[float], seed: int):
        if len(streams) != len(weights) or not streams:
            raise VlbertsError(f"{len(streams)} streams but {len(weights)} weights")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise VlbertsError(f"mixing weights must be >= 0 with a positive sum, got {list(weights)}")
        self.streams, self.weights, self.seed, self.epoch = list(streams), [float(w) for w in weights], seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for s in self.streams:
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        rng = np.random.default_rng([self.seed, self.epoch, _reader()[0], 0x313])
        live = [(iter(s), w) for s, w in zip(self.streams, self.weights) if w > 0]
        while live:
            p = np.array([w for _, w in live])
            i = int(rng.choice(len(live), p=p / p.sum()))
            try:
                yield next(live[i][0])
            except StopIteration:
                del live[i]  # the others keep their relative weights


def mix_streams(streams: Sequence[Iterable[Any]], weights: Sequence[float], seed: int = 0) -> MixedStream:
    """Each next sample comes from stream i with probability weights[i] / sum(weights), drawn from
    (seed, epoch, worker), so a mix of deterministic streams is deterministic.

    A stream that runs out is dropped and the rest are renormalised (the mix then ends when all have
    ended), rather than ending the mix at the first one or restarting it: give `resample=True` streams
    to keep the proportions fixed forever, which is what pre-training on mixed corpora wants.
    """
    return MixedStream(streams, weights, seed)


# --------------------------------------------------------------------------- a whole shard set
def index_store(index: dict[str, Any], path: Path) -> tuple[int, list[str], StoreMetadata]:
    """What an index says of the region store its shards were written from: feature width, fields, metadata."""
    store = index["store"]
    meta = StoreMetadata.from_dict(store.get("metadata") or {}, path=path)
    return int(store["feature_dim"]), list(store["fields"]), meta


@dataclasses.dataclass
class ShardSetCheck:
    """What `check_shard_set` found: the samples it read by kind, and each problem as one line."""

    index: Path
    shards: int = 0  # shards read to their end
    kinds: Counter = dataclasses.field(default_factory=Counter)
    problems: list[str] = dataclasses.field(default_factory=list)
    more_problems: int = 0  # found beyond `max_problems`, counted only

    @property
    def ok(self) -> bool:
        return not self.problems and not self.more_problems

    def add(self, error: VlbertsError | str, max_problems: int) -> None:
        if len(self.problems) < max_problems:
            self.problems.append(str(error))
        else:
            self.more_problems += 1

    def summary(self) -> dict[str, Any]:
        return {"index": str(self.index), "shards_read": self.shards, "samples": sum(self.kinds.values()),
                "kinds": {k: self.kinds[k] for k in KINDS}, "problems": len(self.problems) + self.more_problems}


def check_shard_set(index: str | Path, *, max_problems: int = 100) -> ShardSetCheck:
    """Read a whole shard set once and report every problem in it, for a corpus copied or rewritten
    before a long run. Streaming checks each sample as it reads it, but a rank reads only its own shards,
    so what lies across shards is checked here only:

    - a key, or an image id, in two shards (or twice in one set): one image would be trained on twice,
      or two different images would pass under one id;
    - a shard's sample counts by kind differing from the index's (a shard replaced or cut after writing),
      and the index's totals differing from the sum of its shards' entries (an index edited by hand;
      pre-training sizes its chunks from the total of captioned images);
    - and, as streaming checks them, every shard the index lists being there and readable to its end,
      each sample's members and json, and each image sample's regions against the index
      (`check_sample_record`; the cls_prob width is the first image sample's).

    A damaged tar or member ends that shard (its later samples cannot be found); a sample whose regions
    misfit the index is reported and reading goes on. Memory: one dict entry per key and image id
    (about 150 bytes each: 1 GB for Conceptual Captions' 3.3 million images).
    """
    index = Path(index)
    obj = read_index(index)
    store = index_store(obj, index) if obj.get("store") else None
    report = ShardSetCheck(index)
    listed_total: Counter = Counter()
    for entry in obj["shards"]:
        listed_total.update(_kinds_of(entry, index))
    totals = _kinds_of(obj, index)
    if totals != {k: listed_total[k] for k in KINDS}:
        report.add(VlbertsError(f"the index's totals ({_kind_counts(totals)}) are not the sum of its shards' "
                                f"entries ({_kind_counts(listed_total)})", path=index), max_problems)
    key_at: dict[str, str] = {}  # key -> the shard it was first read in
    image_at: dict[str, str] = {}  # image id -> the shard of its first sample
    cls_prob_width: int | None = None
    for entry in obj["shards"]:
        shard = index.parent / entry["name"]
        name = shard.name  # one string shared by the dicts' entries of this shard
        if not shard.is_file():
            report.add(VlbertsError("shard listed in the index is missing", path=shard), max_problems)
            continue
        kinds: Counter = Counter()
        try:
            for sample in read_shard(shard):
                key, kinds[sample["kind"]] = sample["__key__"], kinds[sample["kind"]] + 1
                image_id = None if sample["kind"] == "text" else str(sample["image_id"])
                if key in key_at:  # one problem per sample: its image id is then most likely the other's too
                    report.add(_sample_error(sample, f"sample key {key} is also in {key_at[key]}"), max_problems)
                elif image_id in image_at:
                    report.add(_sample_error(sample, f"image id {image_id} is also in {image_at[image_id]}"),
                               max_problems)
                key_at.setdefault(key, name)
                if image_id is None:
                    continue
                image_at.setdefault(image_id, name)
                if store is None:
                    report.add(_sample_error(sample, "image sample in a shard set whose index lists no region "
                                             "store"), max_problems)
                    continue
                feature_dim, fields, meta = store
                try:
                    rec = sample_record(sample)
                    if cls_prob_width is None and rec.cls_prob is not None and rec.num_boxes:
                        cls_prob_width = int(rec.cls_prob.shape[1])
                    check_sample_record(sample, rec, feature_dim=feature_dim, fields=fields,
                                        cls_prob_width=cls_prob_width, classes=meta.classes,
                                        attributes=meta.attributes)
                except VlbertsError as e:
                    report.add(e, max_problems)
        except VlbertsError as e:
            report.add(e, max_problems)
            report.kinds.update(kinds)
            continue
        report.shards += 1
        report.kinds.update(kinds)
        listed = _kinds_of(entry, index)
        if {k: kinds[k] for k in KINDS} != listed:
            shown = [k for k in KINDS if kinds[k] or listed[k]]
            report.add(VlbertsError(f"holds {_kind_counts(kinds, shown)} samples; the index lists "
                                    f"{_kind_counts(listed, shown)}", path=shard), max_problems)
    return report


def _kinds_of(entry: dict[str, Any], index: Path) -> dict[str, int]:
    """An index's (or one shard entry's) sample counts by kind, every kind present (0 when not listed)."""
    kinds = entry.get("kinds") or {}
    counts = {k: kinds.get(k, 0) for k in KINDS} if isinstance(kinds, dict) else {}
    if not counts or not all(isinstance(v, int) and v >= 0 for v in counts.values()):
        raise VlbertsError(f"sample counts by kind must be whole numbers, got {kinds!r}", path=index,
                           record=entry.get("name"))
    return counts


def _kind_counts(counts: dict[str, int], kinds: Sequence[str] = KINDS) -> str:
    return ", ".join(f"{counts.get(k, 0)} {k}" for k in kinds)


# --------------------------------------------------------------------------- command line
class _OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line and exit 2, as every `vlberts` command's (argparse prints its usage first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def main(argv: Sequence[str] | None = None) -> int:
    ap = _OneLineParser(prog="python -m vlberts.data.shards", description="Write WebDataset-style tar shards "
                                 "from a region store and its captions, or check a written shard set (--check).")
    ap.add_argument("--store", help="region store (HDF5)")
    ap.add_argument("--captions", help="COCO or Karpathy caption file (omit: image-only samples), or another "
                    "--captions-format")
    ap.add_argument("--captions-format", default="coco", help="coco (COCO or Karpathy), lxmert (LXMERT's corpus "
                    "files, comma-separated: captions, and questions with their answers for image QA), vqa, gqa, "
                    "nlvr2, vcr (as vlberts pretrain --captions_format reads them)")
    ap.add_argument("--image-map", help="nlvr2: the JSON object of image names to store ids, as vlberts pretrain "
                    "--image_map takes it")
    ap.add_argument("--split", default="train", help="Karpathy split of --captions")
    ap.add_argument("--out", help="output directory")
    ap.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    ap.add_argument("--prefix", default="shard")
    ap.add_argument("--image-only", action="store_true", help="also write uncaptioned images as image-only samples")
    ap.add_argument("--withhold", metavar="FILE", help="image ids, one per line, whose captions are left out: written as "
                    "image-only samples (H-VisualBERT's image-only set, e.g. the world's unpaired_images.txt)")
    ap.add_argument("--documents", help="a text corpus in BERT's format (one sentence per line, a blank line between "
                    "documents): each document becomes a text-only sample (with or without --store)")
    ap.add_argument("--overwrite", action="store_true", help="replace a shard set of the same prefix in --out")
    ap.add_argument("--check", metavar="INDEX", help="read the shard set of this index json once and report every "
                    "problem (damaged samples, keys or image ids in two shards, counts unlike the index's)")
    ap.add_argument("--max-problems", type=int, default=100,
                    help="with --check: problems printed (the rest are counted)")
    args = ap.parse_args(argv)
    if args.check is not None:
        writing = [f"--{k.replace('_', '-')}" for k in ("store", "captions", "out", "withhold", "documents",
                                                        "image_only", "overwrite") if getattr(args, k)]
        if writing:  # else they would be silently ignored
            ap.error(f"--check reads a written shard set; it takes no {', '.join(writing)}")
        return _check_command(args.check, args.max_problems)
    if (args.store is None and args.documents is None) or args.out is None:
        ap.error("writing shards needs --store (and/or --documents) and --out (or give --check INDEX)")
    try:
        refs, questions = _caption_file(args.captions, args.captions_format, args.split, args.image_map)
        documents = read_documents(args.documents) if args.documents else []
        index = write_shards(args.store, refs, args.out, shard_size=args.shard_size, prefix=args.prefix,
                             image_only=args.image_only, withhold=args.withhold or (), documents=documents,
                             overwrite=args.overwrite, questions=questions)
    except VlbertsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # the shards finished so far stay (no index: not a set); the one in progress is gone
        print(f"interrupted: no shard index written in {args.out}; run the command again", file=sys.stderr)
        return 130
    obj = read_json(index)
    print(json.dumps({"index": str(index), "shards": len(obj["shards"]), "samples": obj["samples"], "kinds": obj["kinds"]}))
    return 0


def _caption_file(path: str | None, fmt: str, split: str, image_map: str | None = None
                  ) -> tuple[list[CaptionRef] | None, list]:
    """The captions of `path` read as `fmt` (`data.task_texts`; NLVR2's with its `image_map`), and LXMERT's
    questions with their labels apart."""
    if path is None:
        return None, []
    if fmt == "lxmert":
        from vlberts.data.lxmert_corpus import read_lxmert_corpus

        sentences = read_lxmert_corpus(path)
        return ([CaptionRef(s.image_id, s.text) for s in sentences if s.label is None],
                [(CaptionRef(s.image_id, s.text), s.label) for s in sentences if s.label is not None])
    from vlberts.data.task_texts import task_caption_refs

    return task_caption_refs(path, fmt, split=split, image_map=image_map), []


def _check_command(index: str, max_problems: int) -> int:
    """`--check`: each problem as one `error:` line on stderr, then the summary as JSON on stdout; exit 2
    when there was any."""
    try:
        report = check_shard_set(index, max_problems=max(max_problems, 0))
    except VlbertsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for problem in report.problems:
        print(f"error: {problem}", file=sys.stderr)
    if report.more_problems:
        print(f"error: ... and {report.more_problems} more problem(s)", file=sys.stderr)
    print(json.dumps(report.summary()))
    return 0 if report.ok else EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
