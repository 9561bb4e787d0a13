"""The embedded world's vocabulary: one WordPiece vocabulary over every text the world exports.

The models of the papers start from BERT's `vocab.txt`, which covers the language of every downstream
task. A vocabulary trained on the pre-training captions alone does not: the world's captions never say
"what", "how many", "exactly", "only" or "than", and never write "?" or a "z", so VQA, GQA and NLVR2 text
would reach the model spelled letter by letter ("exactly" -> e ##x ##a ##c ##t ##l ##y) or as [UNK]
("what size is it?" -> w ##h ##a ##t [UNK] is it [UNK]). `vlberts world build` therefore writes
`WORLD/vocab/` (`vocab.txt` + `tokenizer_config.json`, a BERT-format tokenizer directory), trained by
`TextTokenizer.train` on every text the world's files hold: the captions, the VQA and GQA questions and
answers (GQA's full-sentence answers too), the NLVR2 statements, the VCR questions, answers and
rationales (object references rendered to their class names, as `data.vcr` renders them), the RefCOCO+
expressions and the text documents. Every word of them is one token of it.

`vlberts pretrain --tokenizer=WORLD/vocab` pre-trains with it, and so do `vlberts demo --vocab=world` and
`vlberts compare --vocab=world`; without it `vlberts pretrain` trains a vocabulary on its captions (the
demo's default: README, "The world's vocabulary", has what each gives). The vocabulary is read back from
the exported files, so it holds exactly what the readers will see.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from vlberts.data.vcr import read_vcr, render_tokens
from vlberts.io import read_json, read_jsonl
from vlberts.text.tokenizer import TextTokenizer

VOCAB_DIR = "vocab"  # WORLD/vocab/: the tokenizer directory
MAX_VOCAB = 1000  # a cap: the demo world's vocabulary holds 5 specials, 38 characters (x2 with ##) and 130 words


def world_texts(root: str | Path) -> Iterator[str]:
    """Every text of the exported world at `root` (module docstring)."""
    root = Path(root)
    for path in sorted((root / "annotations").glob("captions_*.json")):
        yield from (a["caption"] for a in read_json(path)["annotations"])
    for path in sorted((root / "vqa").glob("v2_OpenEnded_world_*_questions.json")):
        yield from (q["question"] for q in read_json(path)["questions"])
    for path in sorted((root / "vqa").glob("v2_world_*_annotations.json")):
        yield from (a["answer"] for ann in read_json(path)["annotations"] for a in ann["answers"])
    for path in sorted((root / "gqa").glob("*_questions.json")):
        for q in read_json(path).values():
            yield from (q["question"], q.get("answer", ""), q.get("fullAnswer", ""))
    for path in sorted((root / "nlvr2").glob("*.json")):
        if path.name != "images.json":
            yield from (rec["sentence"] for rec in read_jsonl(path))
    for path in sorted((root / "vcr").glob("*.jsonl")):
        for ex in read_vcr(path):
            for tokens in (ex.question, *ex.answer_choices, *ex.rationale_choices):
                yield " ".join(render_tokens(tokens, ex.objects).words)
    refs = root / "refcoco+" / "refs.json"
    if refs.is_file():
        yield from (s["sent"] for ref in read_json(refs) for s in ref["sentences"])
    documents = root / "text" / "documents.txt"
    if documents.is_file():
        with open(documents, encoding="utf-8") as f:
            yield from (line for line in f if line.strip())


def world_tokenizer(root: str | Path) -> TextTokenizer:
    """The world's WordPiece vocabulary, trained on `world_texts(root)` (deterministic)."""
    return TextTokenizer.train(world_texts(root), vocab_size=MAX_VOCAB)


def write_world_vocab(root: str | Path) -> Path:
    """Train the world's vocabulary and save it as `root/vocab/`; returns that directory."""
    out = Path(root) / VOCAB_DIR
    world_tokenizer(root).save(out)
    return out
