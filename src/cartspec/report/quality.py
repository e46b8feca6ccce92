"""The quality section of the study's report, and its rows in the published-study table (from quality.json)."""

from __future__ import annotations

import jinja2

from ..quality.models import JudgeCalibration, QualityReport
from ..quality.paired import TEST_NAME


def _cal_text(cal: JudgeCalibration | None) -> str:
    if not cal:
        return "not calibrated"
    return (f"calibration ({cal.mode}, {cal.n} known-answer pairs): accuracy {cal.accuracy:.0%}, "
            f"position consistency {cal.position_consistency:.0%}, tie rate {cal.tie_rate:.0%} — "
            + ("reliable" if cal.reliable else "UNRELIABLE (below 80%): the verdict rests on the structured tests"))


def judge_comparison(quality: QualityReport) -> str:
    """The study's judge row, ours: win/tie/loss per deployment and T, with the judge's calibration."""
    entries = [e for e in quality.entries if e.judge]
    if not entries:
        cals = quality.calibrations
        extra = ("; judge calibrated only: " + "; ".join(_cal_text(c) for c in cals.values())) if cals else ""
        return "not run (structured tests only; `cartspec quality --run DIR` adds the judge)" + extra
    j0 = entries[0].judge
    parts = [f"{e.deployment} T={e.temperature:g}: {e.judge.win} wins / {e.judge.tie} ties / "
             f"{e.judge.loss} losses (sign test p={e.judge.p_value:.2g})" for e in entries]
    judge = quality.judge or {}
    others = [c for m, c in quality.calibrations.items() if m != j0.mode]
    return (f"judge {judge.get('model', j0.model)}, both orders, inconsistent = tie: " + "; ".join(parts)
            + ". " + _cal_text(j0.calibration)
            + "".join(f"; also {_cal_text(c)}" for c in others))


def structured_comparison(quality: QualityReport) -> str:
    entries = quality.entries
    if not entries:
        return "not tested"
    v = [e.verdict for e in entries]
    parts = [f"{e.deployment} T={e.temperature:g}: {e.verdict} (Δ {100 * e.diff:+.1f} pts "
             f"[{100 * e.ci_low:+.1f}, {100 * e.ci_high:+.1f}], {e.n} requests × {e.samples} samples"
             + (f"; ~{e.needed_n} requests" + (f" or {e.needed_samples} samples per request"
                                                 if e.needed_samples else "") + " needed"
                if e.needed_n else "")
             + (f"; {e.identical:.0%} of replies identical to the baseline's" if e.identical else "")
             + ")" for e in entries]
    return (f"{quality.metric}, margin ±{100 * quality.margin:g} pts: {v.count('preserved')} preserved, "
            f"{v.count('inconclusive')} inconclusive, {v.count('worse')} worse of {len(v)}; " + "; ".join(parts))


def quality_sentence(quality: QualityReport) -> str:
    """The verdict's quality sentence: the equivalence verdicts, and an alarm for any that is worse."""
    entries = quality.entries
    parts = [f"{e.deployment} T={e.temperature:g} {e.verdict} ({100 * e.diff:+.1f} pts, 95% CI "
             f"[{100 * e.ci_low:+.1f}, {100 * e.ci_high:+.1f}], {e.n} requests × {e.samples})"
             for e in entries]
    worse = [e for e in entries if e.verdict == "worse"]
    text = (f" Quality, paired {quality.metric} vs the baseline, margin ±{100 * quality.margin:g} "
            f"pts: " + "; ".join(parts) + ".")
    if worse:
        text += " QUALITY ALARM: " + ", ".join(f"{e.deployment} at T={e.temperature:g}" for e in worse) + \
            " answer worse than the baseline beyond the margin."
    return text


SECTION = r"""
<h2 id="quality-verdicts">Quality verdicts (cartspec quality)</h2>
<p class="muted">Test: {{ test }}. Verdict metric: <b>{{ q.metric }}</b>, margin ±{{ "%g"|format(100 * q.margin) }} points.
Replies are paired with the baseline's by request and sample index (the same seed on both); all samples and loads of
a request form one cluster. needed: requests at these samples per request (or samples per request with these requests)
for 80% power, from the observed variance. Judge: both orders, an order-inconsistent verdict is a tie, identical replies
are ties without asking.</p>
<table id="quality-verdicts-table"><tr><th class="l">deployment</th><th>T</th><th>requests</th><th>pairs</th><th>samples</th>
<th>identical</th><th>Δ</th><th>95% CI</th><th class="l">verdict</th><th>needed</th>
{% for m in metrics %}<th>Δ {{ m }} [CI] (p)</th>{% endfor %}<th>judge W/T/L (p)</th><th class="l">judge calibration</th></tr>
{% for e in q.entries %}<tr><td class="l">{{ e.deployment }}</td><td>{{ e.temperature }}</td><td>{{ e.n }}</td><td>{{ e.pairs }}</td>
<td>{{ e.samples }}</td><td>{{ "%.0f%%"|format(100 * e.identical) }}</td><td>{{ "%+.2f"|format(100 * e.diff) }}</td><td>[{{ "%+.2f"|format(100 * e.ci_low) }}, {{ "%+.2f"|format(100 * e.ci_high) }}]</td>
<td class="l {{ 'good' if e.verdict == 'preserved' else 'bad' if e.verdict == 'worse' else '' }}">{{ e.verdict }}</td>
<td>{% if e.needed_n %}{{ e.needed_n }} req{% if e.needed_samples %} / {{ e.needed_samples }} samples{% endif %}{% else %}—{% endif %}</td>
{% for m in metrics %}{% set t = tests_by(e, m) %}<td>{% if t %}{{ "%+.1f"|format(100 * t.diff) }} [{{ "%+.1f"|format(100 * t.ci_low) }}, {{ "%+.1f"|format(100 * t.ci_high) }}] ({{ "%.2g"|format(t.p_value) }}){% else %}—{% endif %}</td>{% endfor %}
<td>{% if e.judge %}{{ e.judge.win }}/{{ e.judge.tie }}/{{ e.judge.loss }} ({{ "%.2g"|format(e.judge.p_value) }}){% else %}—{% endif %}</td>
<td class="l {{ '' if not e.judge or not e.judge.calibration or e.judge.calibration.reliable else 'bad' }}">{{ cal(e.judge.calibration) if e.judge else "—" }}</td></tr>{% endfor %}
</table>
{% if q.calibrations %}<p id="judge-calibration">Judge{% if q.judge %} {{ q.judge.model }}{% endif %}:
{% for m, c in q.calibrations.items() %}{{ cal(c) }}; by kind: {% for k, v in c.by_kind.items() %}{{ k }} {{ "%.0f%%"|format(100 * v) }}{{ ", " if not loop.last }}{% endfor %}.{% if not loop.last %}<br>{% endif %}{% endfor %}</p>{% endif %}
{% set fe = q.entries|selectattr("fields")|list %}{% if fe %}<details><summary>Per-field accuracy, speculative vs baseline</summary>
<table id="quality-fields"><tr><th class="l">deployment</th><th>T</th><th class="l">field</th><th>pairs</th><th>baseline</th><th>speculative</th><th>Δ</th><th>p</th></tr>
{% for e in fe %}{% for f in e.fields %}<tr><td class="l">{{ e.deployment }}</td><td>{{ e.temperature }}</td><td class="l">{{ f.field }}</td><td>{{ f.pairs }}</td>
<td>{{ "%.1f%%"|format(100 * f.baseline) }}</td><td>{{ "%.1f%%"|format(100 * f.candidate) }}</td><td>{{ "%+.1f"|format(100 * f.diff) }}</td><td>{{ "%.2g"|format(f.p_value) }}</td></tr>{% endfor %}{% endfor %}
</table></details>{% endif %}
"""

METRICS = ("exact_match", "field_accuracy", "json_valid", "schema_valid")


def quality_html(quality: QualityReport) -> str:
    env = jinja2.Environment(autoescape=True)
    return env.from_string(SECTION).render(q=quality, test=TEST_NAME, metrics=METRICS,
                                           tests_by=lambda e, m: e.test_of(m), cal=_cal_text)
