"""The demo's report: one self-contained HTML page (figures embedded as data URIs, no network).

Everything is rendered through jinja2 with autoescaping, so captions, paths and labels are escaped.
"""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from vlberts.analysis.figures import head_accuracy_figure, plain_text
from vlberts.analysis.report import best_heads_html
from vlberts.io import atomic_open

# The three phenomena the demo must show (issue "main job": what must hold), as (key, test, wording).
CHECKS = (
    ("image-conditioned MLM beats zeroed regions by >= 25 points",
     lambda s: s["mlm_visual_word_acc"] - s["mlm_visual_word_acc_regions_zeroed"] >= 25.0),
    ("VQA accuracy >= 2x the majority-answer baseline",
     lambda s: s["vqa_accuracy"] >= 2.0 * s["vqa_majority_baseline"]),
    ("best grounding head >= 2x the most-confident-region baseline",
     lambda s: s["grounding_best_head_acc"] >= 2.0 * s["grounding_baseline_acc"]),
    ("best grounding layer in the upper half of the network",
     lambda s: s["grounding_best_layer"] > s["num_layers"] / 2),
)


# How the papers write the architectures' names (the report's title; `summary.json` holds the key).
PAPER_NAMES = {"visualbert": "VisualBERT", "vilbert": "ViLBERT", "vlbert": "VL-BERT", "lxmert": "LXMERT",
               "wvisualbert": "W-VisualBERT"}


def phenomena(summary: dict[str, Any]) -> list[tuple[str, bool]]:
    """Each check's wording and whether the summary passes it."""
    return [(text, bool(test(summary))) for text, test in CHECKS]


def _png_data_uri(fig: Figure, dpi: int = 110) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@plain_text
def _loss_figure(records: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(6.4, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    # Every objective the architecture trained (objectives/recipe.py logs each as `<name>_loss`); W-VisualBERT's
    # alternating text-only and image-only updates log each loss on its own updates only.
    keys = sorted({k for r in records for k in r if k.endswith("_loss")})
    for key in keys:
        points = [(r["step"], r[key]) for r in records if key in r]
        ax.plot([s for s, _ in points], [v for _, v in points], label=key.removesuffix("_loss").replace("_", " "))
    ax.set_xlabel("update")
    ax.set_ylabel("loss")
    ax.set_title("Pre-training losses")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


_TEMPLATE = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(
    """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>vlberts demo report</title>
<style>
body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.pass{color:#1a7f37}.fail{color:#c62828}
img{max-width:100%}code{background:#f3f3f3;padding:0 .2em}
</style></head><body>
<h1>vlberts demo: {{ paper_name }} on the embedded world</h1>
<p>{{ s.images }} images (seed {{ s.seed }}), model <code>{{ s.model }}</code> ({{ s.num_layers }} layers &times; {{ s.num_heads }} heads);
{{ '%.0f' % s.seconds }} s in all{% if s.quick %}; <b>quick mode</b>: a smoke test, not expected to show the phenomena{% endif %}. Generated {{ when }}.</p>
{% if s.arch_settings is defined and s.arch_settings %}<p>This architecture's demo settings, in place of the shared defaults:
{% for k, v in s.arch_settings.items() %}<code>--{{ k }}={{ v }}</code> {% endfor %}(README, "Every architecture's full demo").</p>
{% endif %}
<h2>The three phenomena</h2>
<table><tr><th>check</th><th>result</th></tr>
{% for text, ok in checks %}<tr><td>{{ text }}</td><td class="{{ 'pass' if ok else 'fail' }}">{{ 'holds' if ok else 'does not hold' }}</td></tr>
{% endfor %}</table>

<h2>Headline numbers</h2>
<table><tr><th>number</th><th>value</th></tr>
<tr><td>MLM accuracy on masked colour/shape words, with the image</td><td>{{ '%.2f' % s.mlm_visual_word_acc }}%</td></tr>
<tr><td>same checkpoint, region features zeroed</td><td>{{ '%.2f' % s.mlm_visual_word_acc_regions_zeroed }}%</td></tr>
<tr><td>MLM accuracy on masked direction words (left/right/above/below), with the image</td><td>{{ '%.2f' % s.mlm_direction_word_acc }}%</td></tr>
<tr><td>same checkpoint, region features zeroed</td><td>{{ '%.2f' % s.mlm_direction_word_acc_regions_zeroed }}%</td></tr>
<tr><td>VQA accuracy (official metric, test split)</td><td>{{ '%.2f' % s.vqa_accuracy }}%</td></tr>
<tr><td>VQA majority-answer baseline</td><td>{{ '%.2f' % s.vqa_majority_baseline }}%</td></tr>
<tr><td>best head's entity-grounding accuracy (head {{ s.grounding_best_head }})</td><td>{{ '%.2f' % s.grounding_best_head_acc }}%</td></tr>
<tr><td>most-confident-region baseline</td><td>{{ '%.2f' % s.grounding_baseline_acc }}%</td></tr>
<tr><td>upper bound (some region has IoU &ge; 0.5)</td><td>{{ '%.2f' % s.grounding_upper_bound }}%</td></tr>
<tr><td>layer of the best head</td><td>{{ s.grounding_best_layer }} of {{ s.num_layers }}</td></tr>
{% if s.grounding_nouns_masked_best_head is defined %}<tr><td>best head's entity-grounding accuracy with every noun masked (head {{ s.grounding_nouns_masked_best_head }}, layer {{ s.grounding_nouns_masked_best_layer }}; not a check)</td><td>{{ '%.2f' % s.grounding_nouns_masked_best_head_acc }}%</td></tr>{% endif %}
</table>

<h2>Pre-training</h2>
{% if loss_png %}<img src="{{ loss_png }}" alt="pre-training losses">{% endif %}

{% macro word_table(p) %}<table><tr><th>word</th><th>with image (%)</th><th>regions zeroed (%)</th></tr>
{% for w, a in p.with_regions.per_word.items() %}<tr><td>{{ w }}</td><td>{{ '%.1f' % a }}</td><td>{{ '%.1f' % p.regions_zeroed.per_word[w] }}</td></tr>
{% endfor %}</table>{% endmacro %}
<h2>Masked visual words</h2>
<p>Each colour or shape word of the test captions is masked (all its subwords) and predicted by the
pre-trained MLM head from <code>[CLS] caption [SEP]</code> and the image's regions, then again with the
region features set to zero (boxes kept). {{ probe.with_regions.n }} words.</p>
{{ word_table(probe) }}
<p>Direction words ("left", "right", "above", "below"), probed the same way ({{ probe.directions.with_regions.n }}
words): the caption's text leaves each one's opposite as likely, so only the two referents' boxes in the image
decide it.</p>
{{ word_table(probe.directions) }}

<h2>VQA</h2>
<table><tr><th>answer type</th><th>accuracy (%)</th><th>majority baseline (%)</th></tr>
{% for t, a in vqa.per_answer_type.items() %}<tr><td>{{ t }}</td><td>{{ '%.2f' % a }}</td><td>{{ '%.2f' % vqa.majority_baseline_per_answer_type.get(t, 0) }}</td></tr>
{% endfor %}</table>
<table><tr><th>question type</th><th>accuracy (%)</th></tr>
{% for t, a in vqa.per_question_type.items() %}<tr><td>{{ t }}</td><td>{{ '%.2f' % a }}</td></tr>
{% endfor %}</table>

<h2>Entity grounding by attention heads</h2>
<p>"What Does BERT with Vision Look At?" §3.1: for each entity of the test captions and each head, the
region receiving the most attention from the entity's token (attention to words ignored) is compared with the
gold boxes (IoU &ge; {{ g.options.iou_threshold }}, rule <code>{{ g.options.iou_rule }}</code>, token
<code>{{ g.options.token }}</code>). {{ g.n_entities }} entities in {{ g.n_captions }} captions. Attention maps:
{{ maps }}. Skipped phrases: {{ skipped }}.</p>
<img src="{{ fig3_png }}" alt="entity grounding accuracy per head by layer">
{{ heads_table }}
<table><tr><th>layer</th><th>best head</th><th>max accuracy (%)</th><th>mean accuracy (%)</th><th>active heads</th></tr>
{% for row in layers %}<tr><td>{{ row.layer }}</td><td>{{ row.head }}</td><td>{{ row.max }}</td><td>{{ row.mean }}</td><td>{{ row.active }}</td></tr>
{% endfor %}</table>
{% if by_word %}<p>By the phrase's last word (the word the token option <code>last</code> reads; grounding.json
<code>by_last_word</code>): how many entities, the baseline on them, head {{ by_word[0].overall_head }}'s accuracy on
them, and their own best head.</p>
<table><tr><th>last word</th><th>entities</th><th>baseline (%)</th><th>head {{ by_word[0].overall_head }} (%)</th><th>best head</th><th>its accuracy (%)</th></tr>
{% for r in by_word %}<tr><td>{{ r.group }}</td><td>{{ r.n }}</td><td>{{ '%.2f' % (100 * r.baseline) }}</td><td>{{ '%.2f' % (100 * r.overall_head_accuracy) }}</td><td>{{ r.best_head }}</td><td>{{ '%.2f' % (100 * r.best_accuracy) }}</td></tr>
{% endfor %}</table>{% endif %}

<h2>Timings (s)</h2>
<table><tr><th>step</th><th>seconds</th></tr>
{% for k, v in s.timings.items() %}<tr><td>{{ k }}</td><td>{{ v }}</td></tr>{% endfor %}
</table>
<h2>summary.json</h2>
<pre>{{ summary_json }}</pre>
</body></html>
"""
)


def write_demo_report(
    out: Path, summary: dict[str, Any], *, probe: dict[str, Any], grounding: Any, vqa: dict[str, Any], pretrain_log: Path
) -> Path:
    """Write OUT/report.html from the demo's numbers and the grounding report."""
    from vlberts.training.metrics import MetricsLog

    r = grounding.result
    records = MetricsLog.read(pretrain_log)
    layers = [
        {"layer": i + 1, "head": h.label, "max": f"{100 * r.layer_max[i]:.2f}", "mean": f"{100 * r.layer_mean[i]:.2f}",
         "active": f"{int(r.active[i].sum())}/{r.num_heads}"}
        for i, h in enumerate(r.best_per_layer)
    ]
    html = _TEMPLATE.render(
        s=summary,
        paper_name=PAPER_NAMES.get(summary.get("arch", "visualbert"), summary.get("arch", "")),
        when=time.strftime("%Y-%m-%d %H:%M"),
        checks=phenomena(summary),
        loss_png=_png_data_uri(_loss_figure(records)) if records else "",
        probe=probe,
        vqa=vqa,
        g=r,
        maps=grounding.maps,
        skipped=", ".join(f"{k} {v}" for k, v in grounding.skipped.items()) or "none",
        fig3_png=_png_data_uri(head_accuracy_figure(r)),
        heads_table=Markup(best_heads_html(r, 10)),  # already escaped by its own autoescaping template
        layers=layers,
        by_word=list(getattr(grounding, "breakdowns", {}).get("last_word", []))[:12],
        summary_json=json.dumps(summary, indent=2),
    )
    path = out / "report.html"
    with atomic_open(path) as f:
        f.write(html)
    return path
