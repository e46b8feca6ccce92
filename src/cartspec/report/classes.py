"""The report's table of acceptance per token class (rows from ``analysis.classes``)."""

from __future__ import annotations

import html

from ..analysis.classes import ClassAcceptance
from ..task.classes import CLASSES

NAMES = {"json_structure": "JSON structure", "json_key": "keys", "value_copied": "values copied from the request",
         "value_not_in_request": "values not in the request", "free_text": "free text"}


def by_class_html(rows: list[ClassAcceptance]) -> str:
    """The report's table (an HTML fragment), or "" without rows."""
    if not rows:
        return ""
    head = "".join(f"<th>{NAMES[c]}</th>" for c in CLASSES)
    body = []
    for r in rows:
        skipped = f" (+{r.replies_skipped} skipped)" if r.replies_skipped else ""
        cells = "".join("<td>–</td>" if r.by_class[c] is None else
                        f'<td title="{r.reached[c]} drafts reached">{100 * r.by_class[c]:.0f}%</td>'
                        for c in CLASSES)
        tau = "–" if r.tau is None else f"{r.tau:.2f}"
        rate = "–" if r.acceptance_rate is None else f"{100 * r.acceptance_rate:.1f}%"
        body.append(f'<tr><td class="l">{html.escape(r.deployment)}</td><td>{r.temperature:g}</td>'
                    f'<td class="l">{html.escape(r.request_set)}</td><td>{tau}</td>'
                    f'<td>{rate}</td>{cells}'
                    f'<td>{r.replies}{skipped}</td></tr>')
    return ("<h2>Acceptance per token class</h2>\n<p>From vLLM's per-request, per-step accepted/drafted counts, "
            "placed on each reply's tokens (re-tokenised; a reply whose token count differs from vLLM's is skipped). "
            "Acceptance of a class: accepted drafts of that class / drafts the verifier reached (up to and including "
            "the first rejection). Loads pooled.</p>\n"
            f'<table id="by-class"><tr><th class="l">deployment</th><th>T</th><th class="l">requests</th><th>τ</th>'
            f"<th>acceptance</th>{head}<th>replies</th></tr>\n" + "\n".join(body) + "</table>\n")
