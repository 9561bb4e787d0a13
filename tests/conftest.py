"""Shared fixtures: one tiny embedded world with extracted region features, built once per test session.

Everything the end-to-end tests need (captions, VQA files, Flickr30K Entities, CoNLL-U, a region
store) comes from `vlberts world build` + `vlberts extract` on 60 images, about 15 s on 2 cores.

The suite checks CPU numerics (exact resumes, float tolerances against references). On a machine with a
GPU, every recipe's `device=auto` would take CUDA and bf16 instead, so the suite hides the GPU from itself
and from the CLIs it starts; only the tests marked `gpu` (tests/test_gpu.py) see it. VLBERTS_TEST_CUDA=1
leaves the GPU visible to every test (a check that the CUDA path runs everywhere; CPU-exact assertions
may then fail within rounding).
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

SHOW_CUDA = os.environ.get("VLBERTS_TEST_CUDA") == "1"
_cuda_is_available = torch.cuda.is_available


@pytest.fixture(scope="session", autouse=True)
def _hide_cuda_from_the_cpu_suite():
    """Session fixtures (the tiny pre-trained models) are built on the CPU too, whichever test asks first."""
    if SHOW_CUDA:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


@pytest.fixture(autouse=True)
def _cuda_for_gpu_tests_only(request, monkeypatch):
    if SHOW_CUDA:
        return
    if request.node.get_closest_marker("gpu"):
        monkeypatch.setattr(torch.cuda, "is_available", _cuda_is_available)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CLIs a test starts see no GPU either


@dataclass(frozen=True)
class TinyWorld:
    root: Path  # the world directory
    store: Path  # its region store (HDF5)

    @property
    def captions_train(self) -> Path:
        return self.root / "annotations" / "captions_train.json"

    def vqa(self, split: str) -> tuple[Path, Path]:
        return (self.root / "vqa" / f"v2_OpenEnded_world_{split}_questions.json",
                self.root / "vqa" / f"v2_world_{split}_annotations.json")

    @property
    def entities(self) -> Path:
        return self.root / "flickr30k_entities"


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> TinyWorld:
    from vlberts.recipes.extract import ExtractConfig, extract
    from vlberts.world.build import build_world

    base = tmp_path_factory.mktemp("tiny_world")
    build_world(base / "world", n_images=60, seed=5, workers=1)
    extract(ExtractConfig(world=str(base / "world"), out=str(base / "features.h5"), epochs=2, max_steps=20, seed=0))
    return TinyWorld(base / "world", base / "features.h5")


@pytest.fixture(scope="session")
def tiny_pretrained(tiny_world, tmp_path_factory) -> Path:
    """A 2-layer VisualBERT pre-trained for a few updates on the tiny world: its model directory."""
    from vlberts.recipes.pretrain import PretrainConfig, pretrain

    out = tmp_path_factory.mktemp("tiny_pretrain") / "run"
    return pretrain(PretrainConfig(
        captions=str(tiny_world.captions_train), features=str(tiny_world.store), out=str(out),
        model="visualbert-tiny", vocab_size=200, steps=4, batch_size=8, ckpt_every=100,
    ))


@pytest.fixture(scope="session")
def float16_store(tiny_world, tmp_path_factory) -> Path:
    """The tiny world's store written as float16 (features and class scores), as real stores usually are."""
    from vlberts.features.store import RegionStore, write_store_records

    path = tmp_path_factory.mktemp("f16") / "features16.h5"
    with RegionStore(tiny_world.store) as s:
        return write_store_records(path, s.records(), dtype="float16", metadata=s.metadata)


def random_init_dir(arch: str, pretrained: Path, out: Path) -> Path:
    """A model directory with a randomly initialised `arch` pre-training model and the tokenizer (and
    feature width) of the pre-trained model at `pretrained`: the "no pre-training" control of task tests."""
    import json

    import torch

    from vlberts.models.builders import build_pretraining_model, model_config
    from vlberts.text.tokenizer import TextTokenizer
    from vlberts.training.checkpoint import save_model_dir

    tok = TextTokenizer.load(pretrained)
    visual_dim = json.loads((pretrained / "config.json").read_text())["config"]["visual_dim"]
    torch.manual_seed(0)
    cfg = model_config(arch, vocab_size=tok.vocab_size, visual_dim=visual_dim)
    save_model_dir(out, build_pretraining_model(cfg), cfg, tokenizer=tok)
    return out


def word_selection_counts(ids, labels, tok) -> tuple[int, int]:
    """MLM targets of one masked row (input ids and labels, IGNORE_INDEX where not selected) read per word:
    (words of several subwords selected whole, words selected only in part). Words are found from the
    `##` subwords of the row's original tokens."""
    import numpy as np

    from vlberts.text.masking import IGNORE_INDEX, word_ids_of

    ids, labels = np.asarray(ids), np.asarray(labels)
    sel = labels != IGNORE_INDEX
    own = np.where(sel, labels, ids)  # the original subwords
    w = np.array([-1 if x is None else x for x in word_ids_of(own.tolist(), tok.continuation_ids, tok.special_ids)])
    whole = partial = 0
    for k in set(w[w >= 0].tolist()):
        s = sel[w == k]
        whole += bool(s.all() and len(s) > 1)
        partial += bool(s.any() and not s.all())
    return whole, partial


@contextmanager
def fails_if_it_hangs(seconds: int = 120):
    """Turn a hang into a test failure (SIGALRM, main thread, POSIX): for tests of code that used to loop
    forever on bad input, so that breaking the fix fails the test rather than stalling the suite."""
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"still running after {seconds} s: it hangs"))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
