"""Bad model files and model-side inputs end in a one-line `VlbertsError` naming the file and the record, never
a traceback or a silently wrong result: checkpoint tensors of another kind or with NaN, a fine-tuned model's
answer list, a run's run_config.json, class indices past a model's heads, cls_prob rows that are no
distribution, COCO caption ids and image sizes, parses that are no tree, NLVR2 image maps, detector
weights, retrieval caption ids. Inputs are built here, tiny (no world, no download)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vlberts.analysis.syntactic import Arc, ParseNotTree, SyntacticAccumulator, arcs_from_parse
from vlberts.data.coco import read_caption_refs
from vlberts.data.conllu import parse_conllu
from vlberts.data.nlvr2 import read_image_map
from vlberts.data.retrieval import read_retrieval_split
from vlberts.data.shards import check_sample_record
from vlberts.errors import VlbertsError
from vlberts.features.record import RegionRecord, StoreMetadata, cls_prob_misfit
from vlberts.features.store import RegionStoreWriter
from vlberts.models.builders import build_pretraining_model, model_config
from vlberts.recipes.analyze_grounding import _add_syntactic
from vlberts.recipes.common import fine_tuning_setting
from vlberts.recipes.finetune_qa import build_qa_model, load_qa_model, qa_model
from vlberts.recipes.finetune_retrieval import rescore
from vlberts.recipes.pretrain import PretrainConfig, config_from_args, pretrain
from vlberts.tasks.vqa import AnswerVocab
from vlberts.training.checkpoint import load_pretraining_model, save_model_dir


# --------------------------------------------------------------------------- checkpoints

def _model_dir(path: Path, arch: str = "visualbert-tiny", **kw) -> Path:
    torch.manual_seed(0)
    cfg = model_config(arch, vocab_size=64, visual_dim=16)
    save_model_dir(path, build_pretraining_model(cfg), cfg, **kw)
    return path


def _rewrite(directory: Path, change) -> str:
    """Apply `change(tensor) -> tensor` to the first query weight of model.safetensors; its key."""
    weights = load_file(str(directory / "model.safetensors"))
    key = next(k for k in weights if k.endswith("query.weight"))
    weights[key] = change(weights[key])
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return key


def test_a_checkpoint_tensor_of_another_kind_is_refused_and_half_precision_loads(tmp_path):
    ints = _model_dir(tmp_path / "ints")
    key = _rewrite(ints, lambda t: (t * 100).to(torch.int64))  # a cast would train from a truncated matrix
    weights = ints / "model.safetensors"
    for load in (lambda: load_pretraining_model(ints), lambda: build_qa_model(ints, AnswerVocab(("yes", "no")))):
        with pytest.raises(VlbertsError) as err:
            load()
        assert str(err.value) == (f"{weights}: tensor {key} is stored as int64 but the model's is float32; "
                                  "expected a float32, float16 or bfloat16 tensor")
    half = _model_dir(tmp_path / "bf16")
    _rewrite(half, lambda t: t.to(torch.bfloat16))
    model, _, _ = load_pretraining_model(half)  # precision only: loads
    assert model.state_dict()[key].dtype == torch.float32


def test_init_weights_with_nan_name_the_file_and_the_tensor(tmp_path):
    bad = _model_dir(tmp_path / "nan")
    key = _rewrite(bad, lambda t: t.index_fill(0, torch.tensor([1]), float("nan")))
    message = f"{bad / 'model.safetensors'}: tensor {key} holds NaN or inf"
    with pytest.raises(VlbertsError) as err:  # fine-tuning --init
        build_qa_model(bad, AnswerVocab(("yes", "no")))
    assert str(err.value) == message
    with pytest.raises(VlbertsError) as err:  # pre-training --init, analyses
        load_pretraining_model(bad)
    assert str(err.value) == message


# --------------------------------------------------------------------------- fine-tuned VQA model, run config

def _vqa_model(path: Path, answers: list) -> Path:
    cfg = model_config("visualbert-tiny", vocab_size=64, visual_dim=16)
    save_model_dir(path, qa_model(cfg, len(answers)), cfg, extra={"task": "vqa", "answers": answers})
    return path


@pytest.mark.parametrize("answers, record, message", [
    (["no", "no", "2"], "answers[1]", "duplicate answer 'no' (first at answers[0])"),
    (["no", None, "2"], "answers[1]", "answer must be a string, got null"),
    (["no", 3, "2"], "answers[1]", "answer must be a string, got 3"),
])
def test_a_fine_tuned_vqa_models_answer_list_is_checked(tmp_path, answers, record, message):
    model = _vqa_model(tmp_path / "model", answers)
    with pytest.raises(VlbertsError) as err:
        load_qa_model(model, "vqa")
    assert str(err.value) == f"{model / 'config.json'}: record {record}: {message}"


def test_run_config_values_that_are_there_must_be_positive_integers(tmp_path):
    model = tmp_path / "run" / "model"
    model.mkdir(parents=True)
    assert fine_tuning_setting(model, "max_regions", 36) == 36  # no run_config.json: the default
    run_config = tmp_path / "run" / "run_config.json"
    run_config.write_text(json.dumps({"max_regions": 3, "max_text_len": 10}))
    assert (fine_tuning_setting(model, "max_regions", 36), fine_tuning_setting(model, "epochs", 7)) == (3, 7)
    for key, value, shown in (("max_regions", -5, "-5"), ("max_text_len", "abc", '"abc"'), ("max_regions", True, "true"),
                              ("max_regions", None, "null")):
        run_config.write_text(json.dumps({key: value}))
        with pytest.raises(VlbertsError) as err:
            fine_tuning_setting(model, key, 36)
        assert str(err.value) == f"{run_config}: record {key}: must be a positive integer, got {shown}"


# --------------------------------------------------------------------------- region stores in pre-training

def _world(tmp_path: Path, *, classes=None, attributes=None, obj_top=3, attr_top=3, cls_scale=1.0) -> PretrainConfig:
    """Captions of 6 images and a store of their regions (obj_id < obj_top, attr_id < attr_top, cls_prob rows
    summing to `cls_scale`)."""
    rng = np.random.default_rng(0)
    ids = [str(i) for i in range(1, 7)]
    words = ["a red cube", "two blue balls", "a small green cone", "the big cube", "one red ball", "a cone"]
    captions = {"images": [{"id": int(i), "file_name": f"{i}.png", "width": 32, "height": 32} for i in ids],
                "annotations": [{"id": 10 * int(i) + k, "image_id": int(i), "caption": f"{words[(int(i) + k) % 6]} here"}
                                for i in ids for k in range(2)]}
    (tmp_path / "captions.json").write_text(json.dumps(captions))
    meta = StoreMetadata(classes=classes, attributes=attributes)
    with RegionStoreWriter(tmp_path / "store.h5", 16, metadata=meta, with_cls_prob=5, with_objects=True,
                           with_attrs=True) as w:
        for i in ids:
            n = 4
            x = rng.uniform(0, 14, (n, 2))
            w.add(RegionRecord(i, 32, 32, np.concatenate([x, x + 10], 1), rng.normal(size=(n, 16)),
                               cls_prob=rng.dirichlet(np.ones(5), n) * cls_scale,
                               obj_id=rng.integers(0, obj_top, n), obj_conf=np.full(n, 0.9),
                               attr_id=np.full(n, attr_top - 1) if i == "3" else rng.integers(0, 2, n),
                               attr_conf=np.full(n, 0.8)))
    return PretrainConfig(captions=str(tmp_path / "captions.json"), features=str(tmp_path / "store.h5"),
                          out=str(tmp_path / "run"), vocab_size=80, steps=2, batch_size=4, log_every=1, ckpt_every=100)


def test_class_indices_past_the_model_heads_stop_pre_training_before_it_starts(tmp_path):
    # no vocabulary in the store: lxmert-tiny's heads keep their 10 object / 6 attribute classes
    cfg = _world(tmp_path, attr_top=8)
    with pytest.raises(VlbertsError) as err:
        pretrain(PretrainConfig(**{**vars(cfg), "model": "lxmert-tiny"}))
    assert str(err.value).startswith(f"{cfg.features}: record image 3: attr_id outside the model head's 6-entry "
                                     "vocabulary (range 0..7); the store names no vocabulary")
    assert not (Path(cfg.out) / "checkpoints").exists()


def test_class_indices_past_the_stores_vocabulary_are_found_in_a_damaged_store(tmp_path):
    cfg = _world(tmp_path, classes=["cube", "ball", "cone"], attributes=["red", "blue", "green"])
    with h5py.File(cfg.features, "r+") as f:  # written past the writer's own check
        obj = f["obj_id"][()]
        obj[9] = 999  # image 3's second box (4 boxes an image)
        f["obj_id"][...] = obj
    with pytest.raises(VlbertsError) as err:
        pretrain(PretrainConfig(**{**vars(cfg), "model": "lxmert-tiny"}))
    assert str(err.value) == f"{cfg.features}: record image 3: obj_id outside the store's 3-entry vocabulary (range 0..999)"


def test_a_shard_samples_class_indices_are_checked_against_the_model_heads():
    rec = RegionRecord("5", 32, 32, np.zeros((2, 4)), np.zeros((2, 16)), obj_id=np.array([1, 12]),
                       obj_conf=np.ones(2), attr_id=np.zeros(2), attr_conf=np.ones(2))
    sample = {"__key__": "k5", "__shard__": "s-000000.tar"}
    kw = dict(feature_dim=16, fields=["boxes", "features"], cls_prob_width=None, classes=None, attributes=None)
    assert check_sample_record(sample, rec, **kw) is rec  # no vocabulary, no model: nothing to check against
    with pytest.raises(VlbertsError) as err:
        check_sample_record(sample, rec, **kw, head_sizes={"obj_id": 10})
    assert str(err.value) == "s-000000.tar: record key k5: obj_id outside the model head's 10-entry vocabulary (range 1..12)"


def test_cls_prob_rows_that_are_no_distribution_stop_a_soft_target_objective(tmp_path):
    cfg = _world(tmp_path, cls_scale=5.0)
    with pytest.raises(VlbertsError, match=rf"^{cfg.features}: record image \d: cls_prob row 0 sums to 5, not 1"):
        pretrain(PretrainConfig(**{**vars(cfg), "model": "vilbert-tiny"}))
    # a float16 store's rounding of 1601-class distributions is well inside the tolerance
    rows = np.random.default_rng(1).dirichlet(np.ones(1601), 36).astype(np.float16)
    assert cls_prob_misfit(rows) is None
    assert cls_prob_misfit(rows * 0.9).startswith("cls_prob row 0 sums to 0.9")


# --------------------------------------------------------------------------- annotation files

def _coco(tmp_path: Path, **change) -> Path:
    obj = {"images": [{"id": 1, "file_name": "1.png", "width": 8, "height": 8},
                      {"id": 2, "file_name": "2.png", "width": 8, "height": 8}],
           "annotations": [{"id": 5, "image_id": 1, "caption": "a cube"}, {"id": 6, "image_id": 2, "caption": "a ball"}]}
    for key, (k, field, value) in change.items():
        obj[key][k][field] = value
    path = tmp_path / "captions.json"
    path.write_text(json.dumps(obj))
    return path


def test_coco_caption_ids_are_unique_and_image_sizes_positive(tmp_path):
    assert len(read_caption_refs(_coco(tmp_path))) == 2
    path = _coco(tmp_path, annotations=(1, "id", 5))
    with pytest.raises(VlbertsError) as err:
        read_caption_refs(path)
    assert str(err.value) == f"{path}: record annotations[1]: duplicate annotation id 5 (first at annotations[0])"
    path = _coco(tmp_path, images=(1, "height", 0))
    with pytest.raises(VlbertsError) as err:
        read_caption_refs(path)
    assert str(err.value) == f"{path}: record images[1]: image 2: height must be a positive integer, got 0"
    obj = json.loads(_coco(tmp_path).read_text())
    del obj["annotations"]  # COCO's images without their captions: not a Karpathy file either
    path.write_text(json.dumps(obj))
    with pytest.raises(VlbertsError) as err:
        read_caption_refs(path)
    assert str(err.value) == (f"{path}: neither a COCO captions file (no 'annotations' list) nor a Karpathy split "
                              "file (images[0] has no 'sentences')")


CYCLE = """# sent_id = 8_2
# text = a red cube
1\ta\ta\tDET\tDT\t_\t3\tdet\t_\t_
2\tred\tred\tADJ\tJJ\t_\t3\tamod\t_\t_
3\tcube\tcube\tNOUN\tNN\t_\t1\troot\t_\t_
"""


def test_a_parse_with_a_cycle_is_skipped_and_counted_with_its_id():
    sentence = parse_conllu(CYCLE, "p.conllu")["8_2"]
    words = ("a", "red", "cube")
    with pytest.raises(ParseNotTree, match="parse '8_2': following the heads, some word never reaches a root"):
        arcs_from_parse(sentence, words)
    syn = SyntacticAccumulator()
    _add_syntactic(syn, {"8_2": sentence}, SimpleNamespace(caption_id="8_2", words=words), inp=None)
    assert syn.skipped == {"parse has a cycle (a word that reaches no root)": 1}
    assert syn.skipped_examples == {"parse has a cycle (a word that reaches no root)": ["8_2"]}
    fixed = parse_conllu(CYCLE.replace("1\troot", "0\troot"), "p.conllu")["8_2"]
    assert len(arcs_from_parse(fixed, words)) == 2
    # A caption parsed as two sentences has two roots (spaCy on "a cube. a ball."): both trees are read.
    two = parse_conllu(TWO_SENTENCES, "p.conllu")["9_0"]
    assert not two.is_tree() and arcs_from_parse(two, ("a", "cube", "a", "ball")) == [
        Arc(1, "det", 0), Arc(3, "det", 2)]


TWO_SENTENCES = """# sent_id = 9_0
# text = a cube a ball
1\ta\ta\tDET\tDT\t_\t2\tdet\t_\t_
2\tcube\tcube\tNOUN\tNN\t_\t0\troot\t_\t_
3\ta\ta\tDET\tDT\t_\t4\tdet\t_\t_
4\tball\tball\tNOUN\tNN\t_\t0\troot\t_\t_
"""


def test_an_nlvr2_image_map_value_must_be_an_image_id(tmp_path):
    path = tmp_path / "images.json"
    path.write_text(json.dumps({"train-0-0-img0": 3, "train-0-0-img1": "4"}))
    assert read_image_map(path) == {"train-0-0-img0": "3", "train-0-0-img1": "4"}
    for value, shown in ((None, "null"), ("", '""'), (True, "true")):
        path.write_text(json.dumps({"train-0-0-img0": 3, "train-0-0-img1": value}))
        with pytest.raises(VlbertsError) as err:
            read_image_map(path)
        assert str(err.value) == (f"{path}: record train-0-0-img1: image id must be a non-empty string or an integer, "
                                  f"got {shown}")


def test_detector_weights_with_nan_are_refused_on_load(tmp_path):
    from vlberts.features.world_detector import (DetectorInfo, WorldDetector, WorldDetectorConfig, WorldVocab,
                                                 load_detector, save_detector)

    cfg = WorldDetectorConfig(num_classes=3, num_attributes=2, feature_dim=8)
    torch.manual_seed(0)
    path = tmp_path / "det.safetensors"
    save_detector(path, WorldDetector(cfg), DetectorInfo(cfg, WorldVocab(("a", "b", "c"), ("x", "y"), ("s",))))
    load_detector(path)
    weights = load_file(str(path))
    key = sorted(k for k in weights if k.endswith("weight"))[-1]
    weights[key][0] = float("nan")
    save_file(weights, str(path))
    with pytest.raises(VlbertsError) as err:
        load_detector(path)
    assert str(err.value) == f"{path}: tensor {key} holds NaN or inf"


def test_retrieval_caption_ids_are_unique(tmp_path):
    images = [{"filename": f"{i}.png", "cocoid": i, "split": "test",
               "sentences": [{"raw": f"cube {i} {k}", "tokens": ["cube"], "sentid": 10 * i + k} for k in range(2)]}
              for i in (1, 2)]
    split = tmp_path / "split.json"

    def read(images):
        split.write_text(json.dumps({"images": images}))
        try:
            return [c.caption_id for c in read_retrieval_split(split, "test").captions]
        except VlbertsError as err:
            return str(err)

    assert read(images) == [10, 11, 20, 21]
    images[1]["sentences"][1]["sentid"] = 11
    assert read(images) == f"{split}: record image 2: duplicate sentid 11 (also in image 1); each sentence needs its own id"
    # Positions stand in for sentids in a file without any; a file with some would have them collide.
    for image in images:
        for s in image["sentences"]:
            s.pop("sentid")
    assert read(images) == [0, 1, 2, 3]
    images[1]["sentences"][1]["sentid"] = 0
    assert read(images) == (f"{split}: record image 2: sentences[1] has a sentid, where the split's first sentence "
                            "has none: all or none")

    np.save(tmp_path / "scores.npy", np.eye(2, dtype=np.float32)[[0, 0, 1, 1]])
    index = {"caption_ids": [10, 11, 20, 21], "caption_image_ids": ["1", "1", "2", "2"], "image_ids": ["1", "2"]}
    (tmp_path / "score_index.json").write_text(json.dumps(index))
    assert rescore(tmp_path / "scores.npy")["text_to_image"]["r1"] == 100.0
    (tmp_path / "score_index.json").write_text(json.dumps({**index, "caption_ids": [10, 11, 20, 10]}))
    with pytest.raises(VlbertsError) as err:
        rescore(tmp_path / "scores.npy")
    assert str(err.value) == f"{tmp_path / 'score_index.json'}: record caption_ids[3]: duplicate caption id 10 (first at caption_ids[0])"


# --------------------------------------------------------------------------- model configurations and foreign files

@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "swish"}, "unknown activation 'swish'; valid: gelu"),  # failed when the model was built
    ({"hidden_dropout": 1.5}, "hidden_dropout: must be at most 1, got 1.5"),
    ({"layer_norm_eps": -1.0}, "layer_norm_eps: must be more than 0, got -1"),  # NaN activations, exit 0
    ({"vocab_size": -5}, "vocab_size: must be at least 1, got -5"),
    ({"num_layers": 0}, "num_layers: must be at least 1, got 0"),
    ({"num_layers": 10**6}, "num_layers: must be at most 1000, got 1000000"),  # built layers for minutes
    # sizes the weights do not have: the model they describe was allocated first (10 TB: a traceback)
    ({"max_position_embeddings": 10**13}, "does not fit model.safetensors: bert.embeddings.position_embeddings.weight "
                                          "is 64x32 there but 10000000000000x32 in the model these sizes describe"),
    ({"intermediate_size": 10**13}, "does not fit model.safetensors: bert.encoder.layer.0.intermediate.dense.weight "
                                    "is 64x32 there but 10000000000000x32"),
])  # fmt: skip
def test_a_model_directorys_config_out_of_range_names_the_file(tmp_path, change, message):
    directory = _model_dir(tmp_path / "m")
    meta = json.loads((directory / "config.json").read_text())
    meta["config"].update(change)
    (directory / "config.json").write_text(json.dumps(meta))
    with pytest.raises(VlbertsError) as err:
        load_pretraining_model(directory)
    assert str(err.value).startswith(f"{directory / 'config.json'}: ") and message in str(err.value)
    # ViLBERT's single-stream baseline has no visual layers: a depth of 0 stays valid where it means that
    assert model_config("vilbert-single-stream").v_num_layers == 0


def test_a_model_directorys_config_without_a_size_names_what_its_default_made_of_it(tmp_path):
    """A config.json that lacks num_layers (its default, 12, used) blames config.json, not the weights."""
    directory = _model_dir(tmp_path / "m")
    meta = json.loads((directory / "config.json").read_text())
    del meta["config"]["num_layers"]
    (directory / "config.json").write_text(json.dumps(meta))
    with pytest.raises(VlbertsError) as err:
        load_pretraining_model(directory)
    assert str(err.value).startswith(f"{directory / 'config.json'}: does not fit model.safetensors: the model these "
                                     "sizes describe has bert.encoder.layer.2.") and str(err.value).endswith(
        "(config.json lacks num_layers: the defaults were used)")


def test_a_seed_past_64_bits_is_one_line_not_torchs_overflow(tmp_path):
    with pytest.raises(VlbertsError, match=r"^PretrainConfig.seed: must be at most 9223372036854775807, "
                                           r"got 18446744073709551616$"):
        config_from_args([f"--seed={2**64}"])  # what `vlberts pretrain --seed=...` reads its settings with


def test_foreign_configs_are_objects_of_valid_values_and_name_their_file(tmp_path):
    from vlberts.models.convert_hf import load_hf_visualbert, visualbert_config_from_hf

    hf = {"vocab_size": 30, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 37, "visual_embedding_dim": 16}
    assert visualbert_config_from_hf({**hf, "hidden_size": "32", "num_hidden_layers": 2.0}).hidden_size == 32
    for change, message in (({"hidden_act": "bogus"}, "unknown activation 'bogus'"),
                            ({"attention_probs_dropout_prob": 2}, "attention_dropout: must be at most 1, got 2"),
                            ({"num_attention_heads": 5}, "hidden_size 32 is not a multiple of num_heads 5"),
                            # torch's Embedding would assert on it (a traceback), or take -7 from the end
                            ({"pad_token_id": 30}, "pad_token_id 30 is not a token of the 30-token vocabulary"),
                            ({"pad_token_id": -7}, "pad_token_id -7 is not a token of the 30-token vocabulary"),
                            ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
                            ({"hidden_size": "wide"}, "hidden_size: expected an integer, got 'wide'")):
        with pytest.raises(VlbertsError, match=f"^my/config.json.*{message}"):
            visualbert_config_from_hf({**hf, **change}, where="my/config.json")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(VlbertsError) as err:
        load_hf_visualbert(tmp_path)
    assert str(err.value) == f"{tmp_path / 'config.json'}: expected a JSON object, got list"


def test_a_weights_pickle_with_other_objects_is_refused_in_one_line_and_a_truncated_one_named(tmp_path):
    from vlberts.models.weights import read_state_dict

    evil = tmp_path / "evil" / "pytorch_model.bin"
    evil.parent.mkdir()
    torch.save({"w": torch.zeros(2), "where": Path("/")}, evil)  # a PosixPath: not a tensor
    with pytest.raises(VlbertsError) as err:
        read_state_dict(evil)
    message = str(err.value)
    assert message.startswith(f"{evil}: refused: the file holds pickled objects other than tensors (") and "\n" not in message
    assert "weights_only=False" not in message  # torch's own advice to load it unsafely is not passed on
    cut = tmp_path / "cut" / "pytorch_model.bin"
    cut.parent.mkdir()
    torch.save({"w": torch.zeros(1000)}, cut)
    cut.write_bytes(cut.read_bytes()[:300])
    with pytest.raises(VlbertsError, match=r"cannot read weights \(truncated, corrupt, or not a PyTorch weights file\)"):
        read_state_dict(cut)
    other = tmp_path / "features.h5"
    other.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))  # another kind of file given as weights
    with pytest.raises(VlbertsError) as err:
        read_state_dict(other)
    assert str(err.value) == (f"{other}: cannot read weights: not a PyTorch weights file (it starts with "
                              "b'\\x89HDF', where torch.save writes a zip archive or a pickle)")


def test_a_bert_vocabulary_holds_the_special_tokens_and_utf8_lines(tmp_path):
    from vlberts.text.tokenizer import TextTokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\ncube\nball\n")  # no [MASK]: it would be added past the table
    with pytest.raises(VlbertsError) as err:
        TextTokenizer.from_vocab(vocab)
    assert str(err.value) == f"{vocab}: vocabulary has no [MASK] token (a BERT vocabulary holds [PAD], [UNK], [CLS], [SEP], [MASK])"
    vocab.write_bytes(b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\ncaf\xe9\n")  # Latin-1
    with pytest.raises(VlbertsError, match=rf"^{vocab}: record line 6: not UTF-8 text"):
        TextTokenizer.from_vocab(vocab)
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\ncube\n")
    (tmp_path / "tokenizer_config.json").write_text('{"do_lower_case": "no"}')
    with pytest.raises(VlbertsError, match="do_lower_case must be true or false, got 'no'"):
        TextTokenizer.load(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"do_lower_case": false}')
    assert TextTokenizer.load(tmp_path).lowercase is False and TextTokenizer.load(tmp_path).vocab_size == 6


def test_a_stores_region_classes_past_its_own_class_names_stop_the_representation_views(tmp_path):
    from vlberts.features.store import RegionStore

    cfg = _world(tmp_path, classes=["cube", "ball", "cone"], attributes=["red", "blue", "green"])
    assert len(RegionStore(cfg.features).vocabulary_ids("obj_id")) == 6 * 4  # as written: fits (6 images, 4 boxes each)
    with h5py.File(cfg.features, "r+") as f:  # the class names cut short, past the writer's own check
        obj = f["obj_id"][()]
        obj[9] = 7  # image 3's second box
        f["obj_id"][...] = obj
    with pytest.raises(VlbertsError) as err:
        RegionStore(cfg.features).vocabulary_ids("obj_id")
    assert str(err.value) == f"{cfg.features}: record image 3: obj_id outside the store's 3-entry vocabulary (range 0..7)"


class _Recorded(dict):
    """A dict that notes every key read from it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.read: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


def test_the_settings_a_config_of_changes_may_name_are_those_the_translators_read():
    """`--config` of `vlberts models import --format=lxmert|visualbert` may name the settings the translator
    reads, no others (a misspelt one is an error): the two lists are the translators' own reads."""
    from vlberts.models.convert_hf import HF_VISUALBERT_SETTINGS, visualbert_config_from_hf
    from vlberts.models.convert_hf_lxmert import HF_LXMERT_SETTINGS, lxmert_config_from_hf

    lx = _Recorded(vocab_size=30, hidden_size=32, num_attention_heads=4, intermediate_size=37, l_layers=1,
                   r_layers=1, x_layers=1, visual_feat_dim=16)
    lxmert_config_from_hf(lx)
    assert lx.read == set(HF_LXMERT_SETTINGS)
    vb = _Recorded(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                   visual_embedding_dim=16)
    visualbert_config_from_hf(vb)
    assert vb.read == set(HF_VISUALBERT_SETTINGS)


def test_a_hugging_face_loader_given_a_vlberts_directory_names_the_loader_it_needs(tiny_pretrained):
    """`load_hf_visualbert("runs/pt/model")` said "config.json lacks vocab_size" (and LXMERT's "lacks l_layers")
    of a directory vlberts wrote; it now says what the directory is and which function loads it."""
    from vlberts.models.convert_hf import load_hf_visualbert
    from vlberts.models.convert_hf_lxmert import load_hf_lxmert

    for load in (load_hf_visualbert, load_hf_lxmert):
        with pytest.raises(VlbertsError, match=r"config.json: a vlberts model directory, not a Hugging Face one: load "
                                               r"it with vlberts.training.checkpoint.load_pretraining_model"):
            load(tiny_pretrained)
