"""Typed run configs: strict loading, `--key=value` overrides."""

import dataclasses
import re

import pytest

from vlberts.config import apply_overrides, from_dict, parse_overrides
from vlberts.errors import VlbertsError
from vlberts.models.visualbert import VisualBertConfig
from vlberts.recipes.pretrain import PretrainConfig


def test_overrides_are_typed_and_nested():
    cfg = apply_overrides(PretrainConfig(), ["--lr=3e-4", "--steps=12", "--pairs=false", "--model=visualbert-tiny"])
    assert (cfg.lr, cfg.steps, cfg.pairs, cfg.model) == (3e-4, 12, False, "visualbert-tiny")
    assert parse_overrides(["--a.b=1", "c=2"]) == {"a": {"b": "1"}, "c": "2"}


def test_unknown_keys_list_the_valid_ones():
    with pytest.raises(VlbertsError, match="unknown key.*stpes.*valid keys:.*steps"):
        apply_overrides(PretrainConfig(), ["--stpes=3"])


def test_bad_values_are_errors():
    with pytest.raises(VlbertsError, match="steps"):
        apply_overrides(PretrainConfig(), ["--steps=many"])
    with pytest.raises(VlbertsError, match="visual_spatial"):
        from_dict(VisualBertConfig, {"visual_spatial": "7d"})
    with pytest.raises(VlbertsError, match=r"^override '--steps' is not of the form --key=value \(only on/off settings "
                                           r"may be given without a value\)$"):
        apply_overrides(PretrainConfig(), ["--steps"])
    # a bare name that is no setting at all is an unknown key, listing the valid ones (it said "not of the form")
    with pytest.raises(VlbertsError, match=r"^PretrainConfig: unknown key\(s\) skip_bad; valid keys: .*steps"):
        apply_overrides(PretrainConfig(), ["--skip_bad"])


def test_a_bare_on_off_setting_means_true():
    """`--skip_bad` (or `--skip-bad`) alone is `--skip_bad=true`, as the issues and papers' code spell such flags;
    nested bool settings too; any other setting still needs its value."""
    from vlberts.config import flag_names
    from vlberts.recipes.finetune_vqa import FinetuneVQAConfig

    cfg = apply_overrides(FinetuneVQAConfig(), ["--skip-bad", "--lr=1e-4"])
    assert cfg.skip_bad is True and cfg.lr == 1e-4
    assert apply_overrides(FinetuneVQAConfig(), ["--skip_bad=false"]).skip_bad is False
    assert "pairs" in flag_names(PretrainConfig) and "steps" not in flag_names(PretrainConfig)
    assert parse_overrides(["--a.b", "--c"], flags={"a.b", "c"}) == {"a": {"b": "true"}, "c": "true"}
    with pytest.raises(VlbertsError, match="not of the form"):
        parse_overrides(["--c"])  # without the config's flags a bare name stays an error


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PretrainConfig().steps = 3  # type: ignore[misc]


@pytest.mark.parametrize("name, setting, message", [
    ("visualbert-tiny", dict(hidden_size=0), "VisualBertConfig.hidden_size: must be at least 1, got 0"),
    ("visualbert-tiny", dict(layer_norm_eps=0.0), "VisualBertConfig.layer_norm_eps: must be more than 0, got 0"),
    ("visualbert-tiny", dict(type_vocab_size=0), "VisualBertConfig.type_vocab_size: must be at least 1, got 0"),
    ("visualbert-tiny", dict(hidden_size=32.0), "VisualBertConfig.hidden_size: expected an integer, got 32.0"),
    ("visualbert-tiny", dict(hidden_size="32"), "VisualBertConfig.hidden_size: expected an integer, got '32'"),
    ("visualbert-tiny", dict(hidden_dropout=1.5), "VisualBertConfig.hidden_dropout: must be at most 1, got 1.5"),
    ("visualbert-tiny", dict(initializer_range=-1.0), "VisualBertConfig.initializer_range: must be at least 0, got -1"),
    ("vlbert-tiny", dict(num_region_classes=-1), "VLBertConfig.num_region_classes: must be at least 0, got -1"),
    ("wvisualbert-tiny", dict(num_object_labels=-1), "WVisualBertConfig.num_object_labels: must be at least 0, got -1"),
    ("vilbert-tiny", dict(v_hidden_size=0), "ViLBertConfig.v_hidden_size: must be at least 1, got 0"),
])
def test_a_model_config_built_in_python_is_checked_where_it_is_written(name, setting, message):
    """`config.check_values` in `BertTextConfig.__post_init__`: a model configuration made in Python gets the
    checks a config.json read through `from_dict` gets. Before, `hidden_size=0` or `layer_norm_eps=0` built a
    model that `save_model_dir` wrote and `load_pretraining_model` then refused; 32.0 failed inside torch."""
    from vlberts.models.builders import model_config

    with pytest.raises(VlbertsError, match=re.escape(message) + "$"):
        model_config(name, **setting)
