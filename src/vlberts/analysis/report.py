"""Tables and text summaries of a `GroundingResult` and of a `SyntacticResult` (the paper's Table 2):
Markdown for READMEs and logs, HTML fragments for the report pages. Numbers are printed in percent
with two decimals, as the paper does ("50.77").

HTML goes through jinja2 with autoescaping, so any caller-supplied text (captions, model names) is
escaped; Markdown free text has its table-breaking characters escaped.
"""

from __future__ import annotations

from collections.abc import Sequence

import jinja2
import numpy as np

from vlberts.analysis.grounding import BreakdownRow, GroundingResult, HeadScore
from vlberts.analysis.syntactic import PAPER_TABLE2, SyntacticResult


def best_heads(result: GroundingResult, k: int = 10, *, active_only: bool = False) -> list[HeadScore]:
    """The top-k heads by accuracy (ties: lower layer, then lower head first).

    `active_only` keeps only the heads flagged active, as the paper's Table 2 does ("We only consider
    heads that are allocating on average more than 20% of the attention ... to all image regions").
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    L, H = result.accuracy.shape
    layer, head = np.divmod(np.arange(L * H), H)  # (L*H,) row-major indices
    acc = result.accuracy.reshape(-1)
    order = np.lexsort((head, layer, -acc))  # primary key last: accuracy descending
    if active_only:
        order = order[result.active.reshape(-1)[order]]
    return [result.head(int(layer[i]), int(head[i])) for i in order[:k]]


def _pct(x: float) -> str:
    """A fraction as a percentage with 2 decimals; "n/a" for NaN (a baseline the run could not compute)."""
    return "n/a" if x != x else f"{100.0 * x:.2f}"


def percent(x: float) -> str:
    """`_pct` with its sign: "12.34%", or "n/a" (the command line's summary lines)."""
    return "n/a" if x != x else f"{_pct(x)}%"


def md_text(s: str) -> str:
    """Free text safe inside a Markdown table or line: no pipes, no line breaks, no raw HTML tags."""
    s = " ".join(str(s).split())
    for ch in ("\\", "|", "<", ">", "*", "_", "`", "[", "]"):
        s = s.replace(ch, "\\" + ch)
    return s


def _rows(heads: list[HeadScore]) -> list[dict[str, str]]:
    return [
        {
            "rank": str(i),
            "head": h.label,
            "accuracy": _pct(h.accuracy),
            "mass": _pct(h.region_mass),
            "active": "yes" if h.active else "no",
        }
        for i, h in enumerate(heads, 1)
    ]


def best_heads_markdown(result: GroundingResult, k: int = 10, *, active_only: bool = False) -> str:
    """A Markdown table of the top-k heads: rank, head (<layer>-<head>, 1-based), accuracy (%),
    mean share of the entities' attention on regions (%), active flag."""
    lines = [
        "| rank | head | accuracy (%) | attention on regions (%) | active |",
        "|---:|:---|---:|---:|:---:|",
    ]
    for r in _rows(best_heads(result, k, active_only=active_only)):
        lines.append(f"| {r['rank']} | {r['head']} | {r['accuracy']} | {r['mass']} | {r['active']} |")
    return "\n".join(lines) + "\n"


_ENV = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)

_HEADS_HTML = _ENV.from_string(
    """<table class="grounding-heads">
{% if caption %}
  <caption>{{ caption }}</caption>
{% endif %}
  <thead>
    <tr><th>rank</th><th>head</th><th>accuracy (%)</th><th>attention on regions (%)</th><th>active</th></tr>
  </thead>
  <tbody>
{% for r in rows %}
    <tr class="{{ 'active' if r.active == 'yes' else 'inactive' }}"><td>{{ r.rank }}</td><td>{{ r.head }}</td><td>{{ r.accuracy }}</td><td>{{ r.mass }}</td><td>{{ r.active }}</td></tr>
{% endfor %}
  </tbody>
</table>
"""
)


def best_heads_html(
    result: GroundingResult, k: int = 10, *, active_only: bool = False, caption: str | None = None
) -> str:
    """The same table as `best_heads_markdown`, as an HTML <table> fragment (everything escaped)."""
    return _HEADS_HTML.render(rows=_rows(best_heads(result, k, active_only=active_only)), caption=caption)


def summary_markdown(result: GroundingResult, k: int = 10, *, title: str = "Entity grounding") -> str:
    """A Markdown section: headline numbers, the options used, the best heads, and per-layer numbers."""
    o = result.options
    best = result.best_head
    best_active = result.best_active_head
    cmp = ">=" if o.active_inclusive else ">"
    lines = [
        f"## {md_text(title)}",
        "",
        f"- entities: {result.n_entities} in {result.n_captions} captions",
        "- baseline (most confident region): " + ("n/a (no detection confidences read: --baseline=none)"
                                                  if result.baseline_accuracy != result.baseline_accuracy
                                                  else f"{_pct(result.baseline_accuracy)}%"),
        f"- upper bound (some region is correct): {_pct(result.upper_bound)}%",
        f"- best head: {best.label} at {_pct(best.accuracy)}% ({'active' if best.active else 'inactive'})",
        "- best active head: "
        + ("none" if best_active is None else f"{best_active.label} at {_pct(best_active.accuracy)}%"),
        f"- best layer: {result.best_layer + 1}",
        f"- options: token={o.token}, iou_rule={o.iou_rule}, IoU >= {o.iou_threshold:g}, "
        f"active if mean attention on regions {cmp} {100 * o.active_threshold:g}%",
        "",
        f"### Best {k} heads",
        "",
        best_heads_markdown(result, k),
        "### Per layer",
        "",
        "| layer | best head | max accuracy (%) | mean accuracy (%) | active heads |",
        "|---:|:---|---:|---:|---:|",
    ]
    for layer, h in enumerate(result.best_per_layer):
        lines.append(
            f"| {layer + 1} | {h.label} | {_pct(result.layer_max[layer])} | {_pct(result.layer_mean[layer])} "
            f"| {int(result.active[layer].sum())}/{result.num_heads} |"
        )
    return "\n".join(lines) + "\n"


def breakdown_markdown(rows: Sequence[BreakdownRow], title: str, k: int = 10, *, note: str = "",
                       counted: str = "entities") -> str:
    """Grounding by group (`grounding.GroupedGrounding`: entities by type or last word, a relation's instances
    by query word): the `k` largest groups, each with its count (`counted`: what is counted), the baseline on
    it, the whole's best head's accuracy on it and its own best head."""
    if not rows:
        return ""
    head = rows[0].overall_head
    lines = [
        f"### {md_text(title)}", "",
        (f"{md_text(note)}; " if note else "")
        + (f"{len(rows)} groups, the {k} largest:" if len(rows) > k else f"{len(rows)} group(s):"), "",
        f"| group | {counted} | baseline (%) | head {head} (%) | best head | its accuracy (%) |",
        "|:---|---:|---:|---:|:---|---:|",
    ]
    for r in rows[:k]:
        lines.append(f"| {md_text(r.group)} | {r.n} | {_pct(r.baseline)} | {_pct(r.overall_head_accuracy)} "
                     f"| {r.best_head} | {_pct(r.best_accuracy)} |")
    return "\n".join(lines) + "\n\n"


def table2_markdown(result: SyntacticResult, k: int = 10, *, directions: bool = False,
                    relations: Sequence[str] | None = None) -> str:
    """The paper's Table 2 as Markdown: relation, number of instances, baseline (%), best head's
    accuracy (%), best head (<layer>-<head>). A head marked "(inactive)" is the best of a relation for
    which no head is active (Table 2 lists active heads only; see `Table2Row`)."""
    lines = [
        "| type | instances | baseline (%) | accuracy (%) | head |",
        "|:---|---:|---:|---:|:---|",
    ]
    for row in result.table2(k, directions=directions, relations=relations):
        head = row.head.label + ("" if row.head.active else " (inactive)")
        lines.append(f"| {md_text(row.relation)} | {row.count} | {_pct(row.baseline)} | {_pct(row.head.accuracy)} | {head} |")
    return "\n".join(lines) + "\n"


def syntactic_summary_markdown(result: SyntacticResult, k: int = 10, *, title: str = "Syntactic grounding") -> str:
    """A Markdown section: counts, skipped captions, Table 2 pooled over directions and per direction."""
    skipped = ", ".join(
        f"{md_text(reason)} {n} (e.g. {', '.join(md_text(c) for c in result.skipped_examples.get(reason, []))})"
        for reason, n in result.skipped.items()
    ) or "none"
    lines = [
        f"## {md_text(title)}",
        "",
        f"- captions with a matching parse: {result.n_captions}; captions skipped: {skipped}",
        f"- arcs: {result.n_arcs} (root excluded); without a word in a grounded entity: "
        f"{result.n_arcs_without_entity}; scored (arc, direction) instances: {result.n_instances}"
        + (f"; query word cut off: {result.n_truncated_queries}" if result.n_truncated_queries else ""),
        "- an arc head -r-> dep is read both ways: from the dependent to the region of the head's entity "
        "(dep->head) and from the head to the region of the dependent's entity (head->dep)",
        "",
    ]
    if not result.relations:
        lines.append("No arc instance could be scored.")
        return "\n".join(lines) + "\n"
    lines += [
        f"### Table 2: the {k} most common relations (both directions)",
        "",
        table2_markdown(result, k),
        "### Per direction",
        "",
        table2_markdown(result, k, directions=True),
        "### The paper's ten relations (both directions)",
        "",
        "The relations the paper's Table 2 lists (the ten most common in its Flickr30K parses), those with scored "
        f"instances here: {', '.join(r for r in PAPER_TABLE2 if r in result.relations) or 'none'}.",
        "",
        table2_markdown(result, k, relations=PAPER_TABLE2),
    ]
    return "\n".join(lines)
