"""Foreign checkpoints as vlberts model directories (`vlberts models import`).

The converters (`convert_hf`, `convert_hf_lxmert`, `convert_vilbert`, `convert_vlbert`) load a released
checkpoint into our pre-training model in Python. `import_model` writes what they load as a model
directory (`model.safetensors` + `config.json` + the checkpoint's `vocab.txt`), so that every command
that takes a model (`analyze grounding`, `finetune TASK --init`, `pretrain --init`, ...) reads the
released weights, e.g. the paper's own analysis on the released VisualBERT COCO checkpoint:

    vlberts models import visualbert-coco-pre/ --format hf-visualbert --vocab bert-base-uncased/vocab.txt \
        --out models/visualbert-coco
    vlberts analyze grounding --model=models/visualbert-coco --entities=flickr30k_entities --features=F.h5

Heads the file does not hold (a bare `VisualBertModel`, an LXMERT file without its QA head) stay as the
converter initialised them, as when loading in Python; `config.json` records where the weights came from.
A fine-tuned Hugging Face VisualBERT (`VisualBertForQuestionAnswering`, ...) gives its encoder: its task head
has no place in the pre-training model, and `config.json`'s `left_out` says which head was left out (the
command prints it too).
The directory is written under a temporary name and renamed once complete.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from torch import nn

from vlberts.errors import VlbertsError
from vlberts.io import atomic_dir, read_json_object
from vlberts.text.tokenizer import TextTokenizer, read_do_lower_case


def _hf_visualbert(src: Path, config: Path | None) -> nn.Module:
    from vlberts.models.convert_hf import load_hf_visualbert

    return load_hf_visualbert(src)


def _visualbert(src: Path, config: Path | None) -> nn.Module:
    from vlberts.models.convert_hf import load_original_visualbert

    return load_original_visualbert(src, config)


def _hf_lxmert(src: Path, config: Path | None) -> nn.Module:
    from vlberts.models.convert_hf_lxmert import load_hf_lxmert

    return load_hf_lxmert(src)


def _lxmert(src: Path, config: Path | None) -> nn.Module:
    from vlberts.models.convert_hf_lxmert import load_original_lxmert

    return load_original_lxmert(src, config)


def _assumed_config(load: Callable[[], nn.Module], config: Path | None, assumed: str) -> nn.Module:
    """`load()`; when it was given no --config and the file's shapes disagree with the `assumed` one, the error
    says first that a --config is what fits the file."""
    try:
        return load()
    except VlbertsError as e:
        if config is not None or not e.message.startswith("weights do not fit the model; shape mismatch"):
            raise
        raise VlbertsError(f"weights do not fit {assumed}, which is assumed without --config: pass the file's own "
                           f"config with --config; {e.message.removeprefix('weights do not fit the model; ')}",
                           path=e.path, record=e.record) from None


def _vilbert(src: Path, config: Path | None) -> nn.Module:
    from vlberts.models.convert_vilbert import load_original_vilbert

    # None: the released base config (6 co-attention layers)
    return _assumed_config(lambda: load_original_vilbert(src, config), config,
                           "vilbert-multi-task's base config (bert_base_6layer_6conect.json)")


def _vlbert(src: Path, config: Path | None) -> nn.Module:
    from vlberts.config import from_dict, to_dict
    from vlberts.models.builders import vlbert_base
    from vlberts.models.convert_vlbert import load_original_vlbert
    from vlberts.models.vlbert import VLBertConfig

    # The released files carry no config: vlbert-base, with the settings a --config JSON object changes
    # (e.g. {"num_region_classes": 81}, {"with_match_head": true}); unknown names list the valid ones.
    cfg = vlbert_base()
    if config is not None:
        changes = read_json_object(config)  # a JSON object of settings
        cfg = from_dict(VLBertConfig, {**to_dict(cfg), **changes}, where=str(config))
    # Region features come from a store, so the released end-to-end ResNet (if any) is left behind.
    return _assumed_config(lambda: load_original_vlbert(src, cfg, drop_backbone=True), config, "vlbert-base")


# format -> (loader, what SRC is)
FORMATS: dict[str, tuple[Callable[[Path, Path | None], nn.Module], str]] = {
    "hf-visualbert": (_hf_visualbert, "a Hugging Face save_pretrained directory (VisualBertModel, VisualBertForPreTraining, "
                                      "or a fine-tuned VisualBertForQuestionAnswering, VisualBertForVisualReasoning, "
                                      "VisualBertForMultipleChoice or VisualBertForRegionToPhraseAlignment: its encoder, "
                                      "the task head left out and named in config.json's left_out)"),
    "visualbert": (_visualbert, "uclanlp/visualbert weights (.th: coco_pre_trained.th, vqa_fine_tuned.th, ...); its "
                                "config is read off the tensors, --config a JSON object of Hugging Face VisualBertConfig "
                                "settings that changes it; a fine-tuned file's task head, told by its name, is left out"),
    "hf-lxmert": (_hf_lxmert, "a Hugging Face save_pretrained directory (LxmertModel or LxmertForPreTraining)"),
    "lxmert": (_lxmert, "airsplay/lxmert weights (*_LXRT.pth, e.g. the released Epoch20_LXRT.pth); its config is read "
                        "off the tensors, --config a JSON object of Hugging Face LxmertConfig settings that changes it "
                        "(num_attention_heads is not in the file: hidden_size / 64 unless given)"),
    "vilbert": (_vilbert, "facebookresearch/vilbert-multi-task weights (.bin); --config its JSON config"),
    "vlbert": (_vlbert, "jackroos/VL-BERT weights (PREFIX-EPOCH.model or a state dict); --config a JSON object of "
                        "settings to change from vlbert-base"),
}


def find_vocab(src: Path, vocab: Path | None) -> Path:
    """The BERT `vocab.txt` the checkpoint was trained with: `vocab` if given, else one beside SRC."""
    if vocab is not None:
        return vocab
    here = src if src.is_dir() else src.parent
    if (here / "vocab.txt").is_file():
        return here / "vocab.txt"
    raise VlbertsError("no vocab.txt beside the checkpoint: pass --vocab with the BERT vocabulary it was trained "
                       "with (e.g. bert-base-uncased's vocab.txt)", path=src)


# Word tables are padded past their vocabulary by a few rows at most (to a multiple of 8, 64 or 128)
PADDED_ROWS = 128


def warn_short_vocab(vocab: Path, rows: int) -> None:
    """A vocab.txt much shorter than the checkpoint's word table (more than `PADDED_ROWS` fewer tokens) is
    almost always another vocabulary, e.g. bert-base-cased's 28,996 tokens for an uncased model's 30,522 rows:
    every token would take another token's embedding. A warning on stderr (shorter is not an error: a
    model may have grown its table)."""
    if not rows or not vocab.is_file():
        return
    with open(vocab, "rb") as f:
        tokens = sum(1 for _ in f)
    if rows - tokens > PADDED_ROWS:
        print(f"warning: {vocab}: {tokens} tokens for the checkpoint's {rows} word embeddings; a padded table has a "
              f"few rows more, not {rows - tokens}: is this the vocabulary it was trained with (a cased vocab.txt for "
              "an uncased model?)", file=sys.stderr)


def _lowercase(src: Path, vocab: Path) -> bool:
    """do_lower_case from a tokenizer_config.json beside the vocabulary or the checkpoint (default: True,
    as every released checkpoint of the five papers uses uncased BERT)."""
    for here in (vocab.parent, src if src.is_dir() else src.parent):
        cfg = here / "tokenizer_config.json"
        if cfg.is_file():
            return read_do_lower_case(cfg)
    return True


def import_model(src: str | Path, fmt: str, out: str | Path, *, vocab: str | Path | None = None,
                 config: str | Path | None = None, qa_answers: str | Path | None = None,
                 overwrite: bool = False) -> tuple[nn.Module, Path]:
    """Convert `src` (of format `fmt`, one of `FORMATS`) and write it as the vlberts model directory `out`;
    returns the converted model and `out`.

    qa_answers: the answer table of an LXMERT checkpoint's QA head, one name a row in order (LXMERT's released
    ``all_ans.json``, or any table `read_answer_vocab` reads), recorded as `config.json`'s `qa_answers`, so that
    VQA and GQA fine-tuning start their classifier from the head (`finetune_qa.copy_qa_head`, LXMERT's
    `--loadLXMERTQA`); its length must be the head's rows."""
    from vlberts.tasks.vqa import read_answer_vocab

    from vlberts.training.checkpoint import require_vocab_fits, save_model_dir

    src, out = Path(src), Path(out)
    if fmt not in FORMATS:
        raise VlbertsError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    if not src.exists():
        raise VlbertsError("checkpoint not found", path=src)
    if fmt.startswith("hf-") and not src.is_dir():
        folder = src.resolve().parent
        hint = f"give its folder, {folder}" if (folder / "config.json").is_file() else "give that directory"
        raise VlbertsError(f"--format {fmt} reads a save_pretrained directory (config.json and the weights), not a "
                           f"file: {hint}", path=src)
    if config is not None and fmt not in ("visualbert", "lxmert", "vilbert", "vlbert"):
        raise VlbertsError(f"--config is read for --format visualbert, lxmert, vilbert and vlbert only (the {fmt} checkpoint "
                           "carries its config)")
    vocab_file = find_vocab(src, None if vocab is None else Path(vocab))
    tok = TextTokenizer.from_vocab(vocab_file, lowercase=_lowercase(src, vocab_file))
    loader, _ = FORMATS[fmt]
    model = loader(src, None if config is None else Path(config))
    cfg = model.cfg
    require_vocab_fits(vocab_file, cfg, holder="the checkpoint")
    warn_short_vocab(vocab_file, getattr(cfg, "vocab_size", 0))
    extra = {"imported_from": str(src), "import_format": fmt}
    if qa_answers is not None:
        rows = getattr(cfg, "num_qa_labels", 0)
        answers = read_answer_vocab(qa_answers).answers
        if len(answers) != rows:
            raise VlbertsError(f"--qa_answers names {len(answers)} answers but the checkpoint's QA head has {rows} "
                               "rows" + ("" if rows else " (it has no QA head)"), path=qa_answers)
        extra["qa_answers"] = list(answers)
    left_out = getattr(model, "left_out_head", None)  # a task head the model has no place for (convert_hf)
    if left_out:
        extra["left_out"] = left_out
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_model_dir(tmp, model, cfg, extra=extra, tokenizer=tok)
    return model, out
