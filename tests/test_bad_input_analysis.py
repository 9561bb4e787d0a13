"""Bad input to `vlberts analyze ...` and `vlberts predict ...`: one line naming the file and the record,
exit code 2, no traceback (each input is damaged from the tiny world's real files)."""

from __future__ import annotations

import json

import pytest

from vlberts.cli import main


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """The installed entry point (`VlbertsError` -> one line, exit code 2): (exit code, stdout + stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code or 0, out + err


def damaged_scenes(tiny_world, tmp_path, split: str, change) -> tuple:
    """A copy of the world's scenes.jsonl with `change(record)` applied to the first scene of `split`:
    (path, that scene's line number)."""
    lines = (tiny_world.root / "scenes.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    line = next(i for i, r in enumerate(recs, 1) if r["split"] == split)
    change(recs[line - 1])
    path = tmp_path / "scenes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path, line


def shift_ids(rec):
    for o in rec["objects"]:
        o["object_id"] += 4


def bad_touching(rec):
    rec["touching"] = [[1, 99]]


def one_id_touching(rec):
    rec["touching"] = [[1]]


@pytest.mark.parametrize("change, message", [
    (shift_ids, "object ids must be 1.."),
    (bad_touching, "touching pair [1, 99] names an object the scene does not have"),
    (one_id_touching, "malformed scene: touching entry [1] is not a pair of object ids"),  # was an IndexError
])
def test_attention_graphs_scene_object_ids(change, message, tiny_world, tiny_pretrained, tmp_path, capsys):
    scenes, line = damaged_scenes(tiny_world, tmp_path, "val", change)
    code, output = run_cli(["analyze", "attention-graphs", f"--model={tiny_pretrained}",
                            f"--entities={tiny_world.entities}", f"--features={tiny_world.store}", "--split=val",
                            f"--scenes={scenes}", "--figures=0", f"--out={tmp_path / 'out'}"], capsys)
    assert code == 2, output
    assert output.strip().count("\n") == 0 and "Traceback" not in output
    assert f"{scenes}: record line {line}: {message}" in output


def test_representations_records_the_perplexity_tsne_used(tiny_world, tiny_pretrained, tmp_path, capsys):
    # A perplexity above what the points allow is capped by t-SNE; the JSON must say the one used, not the asked.
    out = tmp_path / "rep"
    code, output = run_cli(["analyze", "representations", f"--model={tiny_pretrained}",
                            f"--entities={tiny_world.entities}", f"--features={tiny_world.store}", "--split=train",
                            "--per_class=5", "--iterations=50", "--perplexity=1e9", f"--out={out}"], capsys)
    assert code == 0, output
    rep = json.loads((out / "representations.json").read_text())
    n_points = len(rep["rows"])
    assert rep["tsne"]["perplexity_asked"] == 1e9
    assert rep["tsne"]["perplexity"] == round((n_points - 1) / 3, 4)


@pytest.mark.parametrize("command", ["grounding", "attention-graphs", "representations"])
def test_analysis_max_text_len_beyond_the_position_embeddings(command, tiny_world, tiny_pretrained, tmp_path,
                                                              capsys):
    # A caption longer than the model's position table with --max_text_len above it crashed in the embedding
    # lookup (IndexError); now one line naming the model's config.json, exit code 2.
    import shutil

    ents = tmp_path / "ents"
    shutil.copytree(tiny_world.entities, ents)
    first = (ents / "val.txt").read_text().split()[0]
    sentences = ents / "Sentences" / f"{first}.txt"
    lines = sentences.read_text().splitlines()
    lines[0] += " " + " ".join(["and it sits near a blue cross"] * 30)
    sentences.write_text("\n".join(lines) + "\n")
    code, output = run_cli(["analyze", command, f"--model={tiny_pretrained}", f"--entities={ents}",
                            f"--features={tiny_world.store}", "--split=val", "--parses=none" if command != "representations"
                            else "--per_class=5", "--max_text_len=1000", f"--out={tmp_path / 'out'}"], capsys)
    assert code == 2, output
    assert output.strip().count("\n") == 0 and "Traceback" not in output
    assert f"{tiny_pretrained / 'config.json'}: --max_text_len=1000 is more than the model's" in output


@pytest.mark.parametrize("command, report", [("grounding", "grounding.json"),
                                             ("attention-graphs", "attention_graphs.json")])
def test_images_directory_holding_none_of_the_drawn_images(command, report, tiny_world, tiny_pretrained, tmp_path,
                                                            capsys):
    # --images=DIR holding none of the images the explorer and figures draw drew grey canvases without a word:
    # one line naming DIR and the first missing file, before the forward passes.
    empty = tmp_path / "photos"
    empty.mkdir()
    first, second = (tiny_world.entities / "val.txt").read_text().split()[:2]
    args = ["analyze", command, f"--model={tiny_pretrained}", f"--entities={tiny_world.entities}",
            f"--features={tiny_world.store}", "--split=val", "--max_images=3", "--parses=none"]
    code, output = run_cli([*args, f"--images={empty}", f"--out={tmp_path / 'out'}"], capsys)
    assert code == 2 and output.strip().count("\n") == 0, output
    assert output.strip().startswith(f"error: {empty}: holds no image the figures draw (")
    assert f"first missing: image {first} as {int(first):012d}.png, {first}.jpg or {first}.png)" in output
    assert not (tmp_path / "out" / report).exists()
    # Some found: the others drawn grey, counted on stderr and in the report.
    some = tmp_path / "some"
    some.mkdir()
    for f in (tiny_world.root / "images").iterdir():
        if f.name != f"{int(first):012d}.png":
            (some / f.name).symlink_to(f)
    drawn = [] if command == "grounding" else [f"--captions={first}_0,{second}_0"]  # the explorer shows 25 captions
    code, output = run_cli([*args, f"--images={some}", *drawn, f"--out={tmp_path / 'out'}"], capsys)
    assert code == 0, output
    counts = json.loads((tmp_path / "out" / report).read_text())["figure_images"]
    assert counts["directory"] == str(some) and counts["missing"] == 1 and counts["drawn"] >= 2
    assert (f"warning: {some}: 1 of {counts['drawn']} images the figures draw not found (first: image {first} as "
            f"{int(first):012d}.png") in output
