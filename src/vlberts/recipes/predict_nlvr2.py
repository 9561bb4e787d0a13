"""Plain inference on NLVR2 with a fine-tuned model (SPEC §9: "hard to run ... for plain inference").

    vlberts predict nlvr2 --model=RUN/model --statements=test2.json --features=F.h5 --out=DIR
        [--image_map=WORLD/nlvr2/images.json]

labels every statement of an NLVR2 JSON-lines file, with or without its labels (NLVR2's test2 is hidden),
and writes

    DIR/predictions.csv   the official predictions file, ``identifier,True|False`` per statement
    DIR/predict.json      what was read: the model, the statements, how many were labelled, skipped records
    DIR/run_config.json   every setting as given, defaults included (written before the predictions)

with the encoding of the fine-tuning run (pair or joint, from the model's config.json) and the same
prediction code (`finetune_nlvr2.predict_nlvr2`), so on the same statements the two files agree line for
line (tests/test_predict_nlvr2.py). `vlberts evaluate nlvr2` scores the file. The statement length and the
regions per image default to the fine-tuning run's own (RUN/run_config.json), else 40 and 36.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from vlberts.config import apply_overrides, from_dict
from vlberts.data.nlvr2 import read_image_map, read_nlvr2
from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import write_json
from vlberts.recipes.common import (PredictConfig, fine_tuning_setting, opt, predict_text_len, prediction_store,
                                    start_prediction, start_recipe, write_run_config)
from vlberts.recipes.finetune_nlvr2 import load_nlvr2_model, predict_nlvr2, resolve_images
from vlberts.tasks.nlvr2 import write_predictions
from vlberts.training.distributed import barrier


@dataclass(frozen=True)
class PredictNLVR2Config(PredictConfig):
    model: str = opt("", "fine-tuned model directory (a `vlberts finetune nlvr2` run's RUN/model)")
    statements: str = opt("", "NLVR2 statements to label (JSON lines; labels not needed: test2.json)")
    features: str = opt("", "region store holding both images of every statement")
    image_map: str = opt("", "JSON {NLVR2 image name: store image id} (the world's nlvr2/images.json); "
                             "empty: the names are the store's keys")
    out: str = opt("runs/predict_nlvr2", "directory for predictions.csv and predict.json")
    max_text_len: int = opt(0, "statement tokens (0: the fine-tuning run's, from RUN/run_config.json; else 40)")
    max_regions: int = opt(0, "regions per image (0: the fine-tuning run's; else 36)")
    batch_size: int = opt(128, "statements per prediction batch")
    skip_bad: bool = opt(False, "drop malformed statement lines and statements whose images are not in the image "
                                "map or the store, counting them in predict.json, instead of stopping at the first")


CONFIG_CLASS = PredictNLVR2Config


def predict_file(cfg: PredictNLVR2Config) -> Path:
    """Label every statement of `cfg.statements` with the fine-tuned model; returns OUT/predictions.csv."""
    for key in ("model", "statements", "features"):
        if not getattr(cfg, key):
            raise VlbertsError(f"predict nlvr2 needs --{key}")
    cfg = start_recipe(cfg)
    device, dist = start_prediction(cfg)
    model_dir, out = Path(cfg.model), Path(cfg.out)
    model, tok = load_nlvr2_model(model_dir)
    bad = BadRecords(skip=cfg.skip_bad)
    statements = read_nlvr2(cfg.statements, bad=bad)
    store, mismatch = prediction_store(cfg, cfg.features, {model_dir: model})
    image_map = read_image_map(cfg.image_map) if cfg.image_map else None
    statements, images = resolve_images(statements, cfg.statements, store, cfg.features, image_map, cfg.image_map, bad)
    if bad.total and dist.main:
        print(bad.warning(), file=sys.stderr)
    if not statements:
        raise VlbertsError("no statement to label", path=cfg.statements)
    max_text_len = predict_text_len(cfg.max_text_len, model.cfg, model_dir, 40)
    max_regions = cfg.max_regions or fine_tuning_setting(model_dir, "max_regions", 36)
    if dist.main:
        write_run_config(out, cfg)
    preds = predict_nlvr2(model, tok, statements, images, store, max_regions=max_regions, max_text_len=max_text_len,
                          batch_size=cfg.batch_size, device=device, precision=cfg.precision, dist=dist)
    path = out / "predictions.csv"
    if dist.main:  # every rank holds every prediction; one writes
        out.mkdir(parents=True, exist_ok=True)
        write_predictions(path, ((ex.identifier, preds[ex.identifier]) for ex in statements))
        write_json(out / "predict.json", {
            "task": "nlvr2", "model": str(model_dir), "statements": cfg.statements, "features": cfg.features,
            "encoding": model.encoding, "predicted": len(statements), "max_text_len": max_text_len,
            "max_regions": max_regions, "skipped_records": bad.to_dict(), "feature_mismatch": mismatch,
            "ranks": dist.world,
        })
    barrier(dist)
    return path


def config_from_args(args: list[str], base: dict | None = None) -> PredictNLVR2Config:
    return apply_overrides(from_dict(PredictNLVR2Config, base or {}), args)
