"""Typed run configs: strict loading, `--key=value` overrides."""

import dataclasses

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
