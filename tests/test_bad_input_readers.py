"""Bad boxes and repeated ids in the task readers: RefCOCO+ instances/refs, Flickr30K Entities XML and split
files, VCR jsonl and metadata, `evaluate vcr`. Each is a one-line `VlbertsError` naming the file and the
record, or with --skip_bad dropped and counted; real-data conventions (a 1-based Flickr box reaching the
image's width, a COCO box a fraction of a pixel past the edge, a zero-area COCO annotation no ref uses) stay
valid. Inputs are built here, small."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from test_bad_settings import run_cli
from vlberts.data.flickr_entities import read_entity_boxes, read_entity_sentences, read_flickr_split
from vlberts.data.flickr_entities_dataset import read_split_images
from vlberts.data.refcoco import read_instances, read_refcoco, read_refs
from vlberts.data.vcr import read_vcr, read_vcr_metadata
from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import require_box
from vlberts.recipes.finetune_refcoco import FinetuneRefCocoConfig, finetune_refcoco
from vlberts.recipes.finetune_vcr import FinetuneVCRConfig, evaluate_vcr, finetune_vcr, read_vcr_file


# --------------------------------------------------------------------------- the shared box check


def test_require_box_slack_and_area():
    assert require_box((0, 0, 640, 480), 640, 480) == (0.0, 0.0, 640.0, 480.0)
    assert require_box((-0.5, -1, 640.9, 481), 640, 480) == (-0.5, -1.0, 640.9, 481.0)  # one pixel of slack
    with pytest.raises(VlbertsError, match=r"^f: record r: box \(-2, 0, 10, 10\) lies outside the 640x480 image"):
        require_box((-2, 0, 10, 10), 640, 480, path="f", record="r")
    with pytest.raises(VlbertsError, match=r"box \(0, 0, 642, 10\) lies outside the 640x480 image"):
        require_box((0, 0, 642, 10), 640, 480)
    with pytest.raises(VlbertsError, match=r"has zero or negative width or height; expected x2 > x1 and y2 > y1"):
        require_box((5, 5, 5, 9), 640, 480)
    assert require_box((5, 5, 5, 9), 640, 480, allow_empty=True) == (5.0, 5.0, 5.0, 9.0)
    with pytest.raises(VlbertsError, match="has negative width or height"):
        require_box((5, 5, 4, 9), 640, 480, allow_empty=True)
    with pytest.raises(VlbertsError, match="image size 0x480 must be positive"):
        require_box((0, 0, 1, 1), 0, 480)


# --------------------------------------------------------------------------- RefCOCO+

REFS = [
    {"ref_id": 0, "ann_id": 101, "image_id": 1, "category_id": 1, "split": "train", "file_name": "a.jpg",
     "sentences": [{"sent": "left man", "sent_id": 0, "tokens": ["left", "man"]}]},
    {"ref_id": 1, "ann_id": 102, "image_id": 1, "category_id": 1, "split": "val", "file_name": "a.jpg",
     "sentences": [{"sent": "right man", "sent_id": 1, "tokens": ["right", "man"]}]},
]  # fmt: skip


def _instances(*anns) -> dict:
    base = [{"id": 101, "image_id": 1, "category_id": 1, "bbox": [0, 0, 20, 30]},
            {"id": 102, "image_id": 1, "category_id": 1, "bbox": [40, 10, 24.4, 38.3]},  # x2 64.4, y2 48.3
            {"id": 103, "image_id": 1, "category_id": 1, "bbox": [5.0, 5.0, 4.0, 0.0]}]  # zero area, as in COCO
    return {"images": [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 48}],
            "annotations": [*base, *anns], "categories": [{"id": 1, "name": "person"}]}


def _refcoco(tmp_path: Path, refs=REFS, instances=None) -> tuple[Path, Path]:
    refs_p, inst = tmp_path / "refs(unc).p", tmp_path / "instances.json"
    refs_p.write_bytes(pickle.dumps(refs, protocol=2))
    inst.write_text(json.dumps(instances or _instances()))
    return refs_p, inst


def test_refcoco_real_conventions_read(tmp_path):
    data = read_refcoco(*_refcoco(tmp_path))
    # a box a fraction of a pixel past the edge, and a zero-area annotation no ref points at, are kept
    assert [r.ref_id for r in data.refs] == [0, 1] and set(data.annotations) == {101, 102, 103}


@pytest.mark.parametrize("bbox, edges", [
    ([-60, -60, 20, 20], "-60, -60, -40, -40"),  # negative
    ([50, 40, 30, 30], "50, 40, 80, 70"),  # past the 64x48 image
])  # fmt: skip
def test_refcoco_annotation_box_outside_the_image(tmp_path, bbox, edges):
    inst = _instances()
    inst["annotations"][1]["bbox"] = bbox
    refs_p, inst_p = _refcoco(tmp_path, instances=inst)
    with pytest.raises(VlbertsError) as err:
        read_refcoco(refs_p, inst_p)
    shown = ", ".join(str(v) for v in bbox)
    assert str(err.value) == (f"{inst_p}: record annotations[1] (id 102): bbox [{shown}] lies outside the 64x48 image "
                              f"(x1, y1, x2, y2 = {edges}); expected 0 <= x1, 0 <= y1, x2 <= 64, y2 <= 48 "
                              "(one pixel of slack)")


def test_refcoco_zero_area_gold_box(tmp_path):
    inst = _instances()
    inst["annotations"][1]["bbox"] = [10, 10, 0, 0]
    refs_p, inst_p = _refcoco(tmp_path, instances=inst)
    with pytest.raises(VlbertsError) as err:
        read_refcoco(refs_p, inst_p)
    assert str(err.value) == (f"{inst_p}: record annotation id 102 (the gold box of ref_id 1): bbox [10, 10, 0, 0] has "
                              "zero or negative width or height (x1, y1, x2, y2 = 10, 10, 10, 10); expected x2 > x1 "
                              "and y2 > y1")


def test_refcoco_duplicate_annotation_id(tmp_path):
    refs_p, inst_p = _refcoco(tmp_path, instances=_instances({"id": 102, "image_id": 1, "category_id": 1,
                                                              "bbox": [0, 0, 5, 5]}))
    with pytest.raises(VlbertsError) as err:
        read_instances(inst_p)
    assert str(err.value) == (f"{inst_p}: record annotations[3] (id 102): duplicate annotation id 102 (first at "
                              "annotations[1])")


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(images=5), "record instances: field images must be a list, got int"),
    (lambda d: d.update(annotations=None), "record instances: field annotations must be a list, got NoneType"),
    (lambda d: d.update(categories={}), "record instances: field categories must be a list, got dict"),
    # a repeated id would silently replace the first image or category
    (lambda d: d["images"].append(dict(d["images"][0], width=5)), "record images[1]: duplicate image id 1 (first at "
                                                                  "images[0])"),
    (lambda d: d["categories"].append({"id": 1, "name": "dog"}), "record categories[1]: duplicate category id 1 "
                                                                 "(first at categories[0])"),
])  # fmt: skip
def test_refcoco_instances_lists_and_their_ids(tmp_path, change, message):
    inst = _instances()
    change(inst)
    _, inst_p = _refcoco(tmp_path, instances=inst)
    with pytest.raises(VlbertsError) as err:
        read_instances(inst_p, BadRecords(skip=True))  # not records one can skip: the file's frame
    assert str(err.value) == f"{inst_p}: {message}"


def test_refcoco_unknown_split_names_the_ref(tmp_path):
    refs_p, _ = _refcoco(tmp_path, refs=[REFS[0], dict(REFS[1], split="valid")])
    with pytest.raises(VlbertsError) as err:
        read_refs(refs_p)
    assert str(err.value) == (f"{refs_p}: record refs[1] (ref_id 1): unknown split 'valid'; expected one of train, "
                              "val, test, testA, testB, testC, testAB, testBC, testAC")


def test_refcoco_bad_boxes_and_ids_are_counted_with_skip_bad(tmp_path):
    inst = _instances({"id": 101, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]},  # duplicate: dropped
                      {"id": 104, "image_id": 1, "category_id": 1, "bbox": [60, 0, 30, 5]})  # outside: dropped
    inst["annotations"][1]["bbox"] = [10, 10, 0, 0]  # ref 1's gold box, zero area
    refs = [*REFS, dict(REFS[0], ref_id=2, split="dev")]
    bad = BadRecords(skip=True)
    data = read_refcoco(*_refcoco(tmp_path, refs=refs, instances=inst), bad)
    assert [r.ref_id for r in data.refs] == [0] and data.annotations[101].bbox == (0.0, 0.0, 20.0, 30.0)
    assert 104 not in data.annotations
    assert bad.counts == {"malformed record": 3, "bad box": 1}


# --------------------------------------------------------------------------- Flickr30K Entities


def _xml(path: Path, *boxes, width=50, height=40) -> Path:
    objects = "".join(f"<object><name>{k + 1}</name><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin><xmax>{b[2]}"
                      f"</xmax><ymax>{b[3]}</ymax></bndbox></object>" for k, b in enumerate(boxes))
    path.write_text(f"<annotation><size><width>{width}</width><height>{height}</height><depth>3</depth></size>"
                    f"{objects}</annotation>")
    return path


def test_flickr_box_reaching_the_edge_is_valid(tmp_path):
    # 1-based inclusive: xmin 1 and xmax = width cover the whole image
    ann = read_entity_boxes(_xml(tmp_path / "1.xml", (1, 1, 50, 40), (20, 20, 20, 20)))
    assert ann.boxes == {1: ((0.0, 0.0, 50.0, 40.0),), 2: ((19.0, 19.0, 20.0, 20.0),)}


@pytest.mark.parametrize("box, edges", [
    ((-78, 5, 10, 10), "-79, 4, 10, 10"),  # negative xmin
    ((5, 5, 900, 10), "4, 4, 900, 10"),  # xmax past <width>
    ((5, 5, 10, 45), "4, 4, 10, 45"),  # ymax past <height>
])  # fmt: skip
def test_flickr_box_outside_its_size(tmp_path, box, edges):
    path = _xml(tmp_path / "8.xml", (1, 1, 10, 10), box)
    with pytest.raises(VlbertsError) as err:
        read_entity_boxes(path)
    xs = ", ".join(str(v) for v in box)
    assert str(err.value) == (f"{path}: record object 1: <bndbox> xmin, ymin, xmax, ymax = {xs} (1-based) lies outside "
                              f"the 50x40 image (x1, y1, x2, y2 = {edges}); expected 0 <= x1, 0 <= y1, x2 <= 50, "
                              "y2 <= 40 (one pixel of slack)")


def test_flickr_split_file_listing_an_image_twice(tmp_path):
    (tmp_path / "test.txt").write_text("8\n9\n\n8\n")
    with pytest.raises(VlbertsError) as err:
        read_flickr_split(tmp_path, "test")
    assert str(err.value) == (f"{tmp_path / 'test.txt'}: record line 4: duplicate image id '8' (first at "
                              "line 1)")
    (tmp_path / "test.txt").write_text("8\n9\n")
    assert read_flickr_split(tmp_path, "test") == ["8", "9"]


class _Store:
    path = "fake.h5"

    def __contains__(self, image_id):
        return True


def test_flickr_bad_box_is_counted_with_skip_bad(tmp_path):
    for d in ("Sentences", "Annotations"):
        (tmp_path / d).mkdir()
    for image_id, box in (("1", (1, 1, 10, 10)), ("2", (-5, 1, 10, 10))):
        (tmp_path / "Sentences" / f"{image_id}.txt").write_text("[/EN#1/people a man] .\n")
        _xml(tmp_path / "Annotations" / f"{image_id}.xml", box)
    (tmp_path / "train.txt").write_text("1\n2\n")
    bad = BadRecords(skip=True)
    images = read_split_images(tmp_path, "train", _Store(), bad)
    assert [im.image_id for im in images] == ["1"] and bad.counts == {"malformed entities file": 1}
    assert bad.first.startswith(f"{tmp_path / 'Annotations' / '2.xml'}: record object 0: <bndbox> xmin, ymin, xmax, "
                                "ymax = -5, 1, 10, 10 (1-based) lies outside the 50x40 image")


def test_flickr_annotations_of_another_image_size_than_the_store(tmp_path):
    """Gold boxes in one frame and the store's regions in another (features of resized images) would score every
    head wrongly and silently: an error naming the store and the image, or a counted skip; a pixel of slack."""
    for d in ("Sentences", "Annotations"):
        (tmp_path / d).mkdir()
    for image_id in ("1", "2", "3"):
        (tmp_path / "Sentences" / f"{image_id}.txt").write_text("[/EN#1/people a man] .\n")
        _xml(tmp_path / "Annotations" / f"{image_id}.xml", (1, 1, 10, 10))  # <size> 50 x 40
    (tmp_path / "train.txt").write_text("1\n2\n3\n")

    class Sized(_Store):
        def image_size(self, image_id):
            return {"1": (50, 40), "2": (51, 39), "3": (100, 80)}[image_id]

    with pytest.raises(VlbertsError) as err:
        read_split_images(tmp_path, "train", Sized(), BadRecords())
    assert str(err.value) == ("fake.h5: record image 3: the store's image is 100x80 but Annotations/3.xml gives <size> "
                              "50x40: its gold boxes and the store's regions are in different frames (features of "
                              "resized images?)")
    bad = BadRecords(skip=True)
    assert [im.image_id for im in read_split_images(tmp_path, "train", Sized(), bad)] == ["1", "2"]
    assert bad.counts == {"image size differs": 1}


# --------------------------------------------------------------------------- VCR


def _vcr_line(annot_id: str, **over) -> str:
    rec = {"annot_id": annot_id, "img_id": "1", "img_fn": "x.jpg", "metadata_fn": "x.json", "objects": ["person"],
           "question": ["Why", "is", [0], "here", "?"], "answer_choices": [["a"], ["b"], ["c"], ["d"]],
           "rationale_choices": [["e"], ["f"], ["g"], ["h"]], "answer_label": 0, "rationale_label": 1}
    return json.dumps({**rec, **over}) + "\n"


def test_vcr_duplicate_annot_id_names_both_lines(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text(_vcr_line("val-0") + _vcr_line("val-1") + "\n" + _vcr_line("val-0"))
    message = f"{path}: record line 4: duplicate annot_id 'val-0' (first at line 1)"
    with pytest.raises(VlbertsError) as err:
        read_vcr(path)
    assert str(err.value) == message
    with pytest.raises(VlbertsError) as err:
        read_vcr_file(path, BadRecords(), require_labels=True)  # finetune and predict vcr
    assert str(err.value) == message
    bad = BadRecords(skip=True)
    assert [ex.annot_id for ex in read_vcr_file(path, bad, require_labels=True)] == ["val-0", "val-1"]
    assert bad.total == 1 and bad.first == message


def _metadata(path: Path, boxes, width=128, height=96) -> Path:
    path.write_text(json.dumps({"boxes": boxes, "names": ["person"] * len(boxes), "width": width, "height": height}))
    return path


def test_vcr_metadata_boxes_inside_width_and_height(tmp_path):
    ok = read_vcr_metadata(_metadata(tmp_path / "ok.json", [[0, 0, 128, 96, 0.9], [10.5, 2, 128.5, 50, 0.5]]))
    assert ok.boxes == ((0.0, 0.0, 128.0, 96.0), (10.5, 2.0, 128.5, 50.0))
    path = _metadata(tmp_path / "neg.json", [[1, 1, 5, 5, 0.9], [-90, -90, -50, -50, 0.9]])
    with pytest.raises(VlbertsError) as err:
        read_vcr_metadata(path)
    assert str(err.value) == (f"{path}: record boxes[1]: box (-90, -90, -50, -50) lies outside the 128x96 image; "
                              "expected 0 <= x1, 0 <= y1, x2 <= 128, y2 <= 96 (one pixel of slack)")
    path = _metadata(tmp_path / "w64.json", [[76, 44, 111, 79, 0.9]], width=64)  # width halved
    with pytest.raises(VlbertsError, match=r"record boxes\[0\]: box \(76, 44, 111, 79\) lies outside the 64x96 image"):
        read_vcr_metadata(path)
    path = _metadata(tmp_path / "zero.json", [[5, 5, 5, 9, 0.9]])
    with pytest.raises(VlbertsError, match=r"record boxes\[0\]: box \(5, 5, 5, 9\) has zero or negative width"):
        read_vcr_metadata(path)


def test_evaluate_vcr_rejects_predictions_for_unknown_questions(tmp_path, capsys):
    ann = tmp_path / "val.jsonl"
    ann.write_text(_vcr_line("val-0") + _vcr_line("val-1"))
    scores = {"val-0": [0.7, 0.1, 0.1, 0.1], "val-1": [0.1, 0.6, 0.2, 0.1]}
    qa, qar = tmp_path / "qa.json", tmp_path / "qar.json"
    qa.write_text(json.dumps({**scores, "val-9999": [0.25] * 4}))
    qar.write_text(json.dumps(scores))
    code, out, err = run_cli(["evaluate", "vcr", f"--annotations={ann}", f"--qa={qa}", f"--qar={qar}"], capsys)
    assert code == 2 and out == "" and err == (f"error: {qa}: record annot_id val-9999: annot_id val-9999 is not a "
                                               f"question of {ann} (1 such); expected predictions for its questions "
                                               "only\n")
    qa.write_text(json.dumps(scores))
    assert evaluate_vcr(ann, qa, qar)["num_questions"] == 2


def _vcr_cfg(world, init: Path, tmp_path: Path, train: Path, **kw) -> FinetuneVCRConfig:
    base = dict(init=str(init), features=str(world.store), out=str(tmp_path / "run"),
                train_file=str(train), eval_file=str(world.root / "vcr" / "val.jsonl"), device="cpu")
    return FinetuneVCRConfig(**{**base, **kw})


def test_vcr_metadata_naming_other_objects_than_the_record(tiny_world, tmp_path):
    """A metadata file whose names disagree with the record's objects (another image's file, or the objects in
    another order) would give each object another's box: refused, or counted with --skip_bad."""
    import shutil

    from vlberts.features.store import RegionStore
    from vlberts.recipes.finetune_vcr import usable_examples

    val = read_vcr(tiny_world.root / "vcr" / "val.jsonl")
    examples = [val[0], next(ex for ex in val if ex.metadata_fn != val[0].metadata_fn)]  # two images
    meta_dir = tmp_path / "metadata"
    shutil.copytree(tiny_world.root / "vcr" / "metadata", meta_dir)
    meta_path = meta_dir / examples[0].metadata_fn
    meta = json.loads(meta_path.read_text())
    meta["names"] = meta["names"][1:] + meta["names"][:1]  # the same classes, rotated
    assert meta["names"] != list(examples[0].objects)
    meta_path.write_text(json.dumps(meta))
    store = RegionStore(tiny_world.store)
    args = ("val.jsonl", store, str(tiny_world.store), "iou", meta_dir)
    with pytest.raises(VlbertsError, match=rf"^{meta_path}: record {examples[0].annot_id}: metadata names object "
                                           r"\d+ '\w+', the record '\w+' \(\d+ of \d+ differ\)$"):
        usable_examples(examples, *args, BadRecords())
    bad = BadRecords(skip=True)
    assert usable_examples(examples, *args, bad) == examples[1:] and bad.counts == {"bad metadata": 1}


def test_finetune_vcr_without_a_metadata_folder_says_so(tiny_world, tiny_pretrained, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text((tiny_world.root / "vcr" / "train.jsonl").read_text())
    with pytest.raises(VlbertsError) as err:
        finetune_vcr(_vcr_cfg(tiny_world, tiny_pretrained, tmp_path, train, skip_bad=True))
    assert str(err.value).startswith(f"{tmp_path / 'metadata'}: metadata folder not found: --object_regions=iou "
                                     "reads each record's metadata_fn from it")


def test_finetune_vcr_all_train_records_skipped_shows_the_skips_first(tiny_world, tiny_pretrained, tmp_path, capsys):
    lines = (tiny_world.root / "vcr" / "train.jsonl").read_text().splitlines()[:3]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({**json.loads(x), "img_id": "nope"}) + "\n" for x in lines))
    args = ["finetune", "vcr", f"--init={tiny_pretrained}", f"--features={tiny_world.store}",
            f"--train_file={train}", f"--eval_file={tiny_world.root / 'vcr' / 'val.jsonl'}",
            f"--metadata_dir={tiny_world.root / 'vcr' / 'metadata'}", f"--out={tmp_path / 'run'}", "--device=cpu",
            "--skip_bad=true"]
    code, _, err = run_cli(args, capsys)
    warning, error = err.strip().splitlines()
    assert code == 2 and warning.startswith("warning: skipped 3 bad records (3 missing features); first: "
                                            f"{tiny_world.store}: record train-")
    assert error == (f"error: {train}: no usable training questions (the file holds none, or --skip_bad dropped "
                     "them all)")


def test_finetune_refcoco_all_train_refs_skipped_shows_the_skips_first(tiny_world, tiny_pretrained, tmp_path, capsys):
    folder = tiny_world.root / "refcoco+"
    refs = json.loads((folder / "refs.json").read_text())
    refs = [dict(r, ann_id=10**9) if r["split"] == "train" else r for r in refs]
    n = sum(r["ann_id"] == 10**9 for r in refs)
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    cfg = FinetuneRefCocoConfig(init=str(tiny_pretrained), out=str(tmp_path / "run"), features=str(tiny_world.store),
                                refs=str(tmp_path / "refs.json"), instances=str(folder / "instances.json"),
                                device="cpu", skip_bad=True)
    with pytest.raises(VlbertsError, match="no training expressions in split 'train'"):
        finetune_refcoco(cfg)
    err = capsys.readouterr().err
    assert err.startswith(f"warning: skipped {n} bad records ({n} missing annotation); first: "), err


def test_flickr_sentences_file_without_a_caption(tmp_path):
    # its image would drop out of every count of an analysis without a word
    path = tmp_path / "8.txt"
    path.write_text("\n\n")
    with pytest.raises(VlbertsError) as err:
        read_entity_sentences(path)
    assert str(err.value) == f"{path}: holds no caption (an image's Sentences file has one per line)"


# --------------------------------------------------------------------------- the world's scenes.jsonl

def _scene_line(image_id: int, box: list[int]) -> str:
    obj = {"object_id": 1, "shape": "circle", "colour": "red", "size": "small", "box": box}
    return json.dumps({"image_id": image_id, "width": 64, "height": 64, "split": "test", "objects": [obj]})


def test_scene_boxes_inside_the_image_and_each_image_once(tmp_path):
    from vlberts.world.scene import read_scenes

    path = tmp_path / "scenes.jsonl"
    path.write_text(_scene_line(1, [2, 2, 10, 10]) + "\n" + _scene_line(2, [0, 0, 64, 64]) + "\n")
    assert [s.image_id for s, _ in read_scenes(path)] == [1, 2]
    for lines, message in (
        ([_scene_line(1, [10, 10, 5, 5])], "record line 1 object 0: box (10, 10, 5, 5) has zero or negative width"),
        ([_scene_line(1, [-50, -50, 500, 500])], "record line 1 object 0: box (-50, -50, 500, 500) lies outside the 64x64 image"),
        ([_scene_line(1, [2, 2, 10, 10]), _scene_line(1, [3, 3, 9, 9])], "record line 2: duplicate image_id 1 (first at line 1)"),
    ):
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(VlbertsError) as err:
            read_scenes(path)
        assert str(err.value).startswith(f"{path}: {message}"), str(err.value)


@pytest.mark.parametrize("change, message", [
    ({"objects": [{"object_id": 2}]}, "object ids must be 1..1 in order, got [2]"),
    ({"touching": [[1, 3]]}, "touching pair [1, 3] names an object the scene does not have (object ids 1..1)"),
])
def test_scene_object_ids_are_the_draw_order_for_every_reader(change, message, tmp_path):
    # The relations read object k as row k - 1 and `touching` by id: other ids indexed out of range, or
    # related the wrong objects without a word. The scenes reader checks them (was attention-graphs only).
    from vlberts.world.scene import read_scenes

    rec = json.loads(_scene_line(1, [2, 2, 10, 10]))
    if "objects" in change:
        rec["objects"][0].update(change["objects"][0])
    else:
        rec.update(change)
    path = tmp_path / "scenes.jsonl"
    path.write_text(_scene_line(5, [2, 2, 10, 10]) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(VlbertsError) as err:
        read_scenes(path)
    assert str(err.value) == f"{path}: record line 2: {message}"


# --------------------------------------------------------------------------- feature import sources


@pytest.mark.parametrize("fmt", ["butd-tsv", "lxmert-tsv", "ban-h5"])
def test_feature_import_of_a_directory_where_a_file_is_expected_says_so(fmt, tmp_path, capsys):
    # it said "file not found" (or, for ban-h5, HDF5's errno 21 dump) for a folder that is plainly there
    src = tmp_path / "features"
    src.mkdir()
    out = tmp_path / "s.h5"
    code, _, err = run_cli(["features", "import", str(src), "--format", fmt, "--out", str(out)], capsys)
    assert code == 2 and err == f"error: {src}: is a directory, not a file (--format {fmt} reads one file)\n"
    assert not out.exists()


def test_an_output_file_given_as_an_existing_directory_is_refused_before_the_work(tiny_world, tmp_path, capsys):
    # it imported every record, then failed naming its hidden temporary file
    tsv, out = tmp_path / "f.tsv", tmp_path / "folder"
    code, _, err = run_cli(["features", "export", str(tiny_world.store), "--format", "butd-tsv", "--out", str(tsv)],
                           capsys)
    assert code == 0, err
    out.mkdir()
    code, _, err = run_cli(["features", "import", str(tsv), "--format", "butd-tsv", f"--out={out}", "--overwrite"],
                           capsys)
    assert code == 2 and err == f"error: {out}: is a directory, where a file is written: give a file name\n"
    assert list(out.iterdir()) == []


def test_feature_import_formats_that_read_a_directory_still_take_one(tmp_path, capsys):
    src = tmp_path / "features"
    src.mkdir()
    code, _, err = run_cli(["features", "import", str(src), "--format", "vlbert-json", "--out", str(tmp_path / "s.h5")],
                           capsys)
    assert code == 2 and err == (f"error: {src}: holds no .json file: vlbert-json reads a directory of per-image "
                                 ".json files, or a .zip of them\n")  # read as a directory
    import torch

    torch.save({"state_dict": {}}, tmp_path / "vl-bert-base-prec.model")  # a zip too, of no .json
    code, _, err = run_cli(["features", "import", str(tmp_path / "vl-bert-base-prec.model"), "--format", "vlbert-json",
                            "--out", str(tmp_path / "s.h5")], capsys)
    assert code == 2 and err.startswith(f"error: {tmp_path / 'vl-bert-base-prec.model'}: holds no .json file")


def _vqa_files(tmp_path, n: int = 3) -> tuple[dict, dict]:
    questions = {"questions": [{"image_id": 1, "question": f"is it red {i}?", "question_id": 10 + i} for i in range(n)]}
    answers = [{"answer": "yes", "answer_confidence": "yes", "answer_id": j + 1} for j in range(10)]
    annotations = {"annotations": [{"question_type": "is it", "multiple_choice_answer": "yes", "answers": answers,
                                    "image_id": 1, "answer_type": "yes/no", "question_id": 10 + i}
                                   for i in range(n)]}
    return questions, annotations


@pytest.mark.parametrize("damage, kind", [
    (lambda q, a: q["questions"][1].update(question_id="abc"), "malformed record"),  # the question's id unreadable
    (lambda q, a: a["annotations"][1].pop("answers"), "malformed record"),  # the annotation lacks its answers
])
def test_one_bad_vqa_record_is_counted_once(damage, kind, tmp_path):
    """--skip_bad counted a question whose id could not be read twice (its annotation then had "no question"),
    and an annotation without answers twice (its question then had "no annotation")."""
    from vlberts.data.vqa import read_vqa

    q, a = _vqa_files(tmp_path)
    damage(q, a)
    (tmp_path / "q.json").write_text(json.dumps(q)), (tmp_path / "a.json").write_text(json.dumps(a))
    bad = BadRecords(skip=True)
    examples = read_vqa(tmp_path / "q.json", tmp_path / "a.json", bad)
    assert [ex.question_id for ex in examples] == [10, 12]
    assert dict(bad.counts) == {kind: 1}


def test_a_refcoco_ref_whose_annotation_was_bad_is_not_counted_again(tmp_path):
    """A box outside its image is a malformed annotation in instances.json; the ref that points to it was
    counted a second time, as "missing annotation"."""
    from test_refcoco_task import _fixture

    refs, instances = _fixture(tmp_path)  # 3 refs; ref 1's gold box is annotation 10 of a 100 x 100 image
    data = json.loads(instances.read_text())
    data["annotations"][0]["bbox"] = [105, 0, 3, 3]
    instances.write_text(json.dumps(data))
    bad = BadRecords(skip=True)
    kept = read_refcoco(refs, instances, bad)
    assert dict(bad.counts) == {"malformed record": 1}
    assert sorted(r.ref_id for r in kept.refs) == [2, 3]
