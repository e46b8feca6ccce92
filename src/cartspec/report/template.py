"""The report's HTML: one file, no external resources (plots are inline PNG data URIs)."""

from __future__ import annotations

from typing import Any

import jinja2

TEMPLATE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>cartspec study{% if summary.run.preset %} — {{ summary.run.preset }}{% endif %}</title>
<style>
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:.8em 0;font-size:12.5px}th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}.verdict{background:#f5f9ff;border-left:4px solid #3a7bd5;padding:.8em 1em}
.failed{color:#b00}.good{color:#070}.bad{color:#b00}figure{margin:1.2em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;font-size:12.5px}.muted{color:#777;font-size:12px}
</style></head><body>
<h1>cartspec study{% if summary.run.preset %}: <code>{{ summary.run.preset }}</code> preset{% endif %}</h1>
<p class="muted">Run {{ summary.run.dir }} · {{ summary.run.machine.cpu or "" }}, {{ summary.run.machine.cores }} cores,
{% if summary.run.engine.hardware %}{{ summary.run.engine.hardware }}, {% endif %}{% if summary.run.dtypes %}dtype {{ summary.run.dtypes|join(", ") }}, {% endif %}
{{ summary.run.machine.memory_gib }} GiB · {{ summary.run.engine.vllm or "" }} · torch {{ summary.run.engine.torch or "?" }}{% if summary.run.engine.cartspec_commit and summary.run.engine.cartspec_commit != "-" %} · cartspec {{ summary.run.engine.cartspec_commit }}{% endif %}
· sweep time {{ "%.1f"|format(summary.run.seconds / 60) }} min over {{ summary.run.invocations|length }} invocation(s)
· {% if summary.run.interleave > 1 %}deployments interleaved: up to {{ summary.run.interleave }} servers up at once, each point measured on every one in turn{% if summary.run.rounds > 1 %}, in {{ summary.run.rounds }} slices taking turns{% if summary.run.restart_rounds %}, every server started again between rounds in rotated order{% endif %}{% endif %}{% else %}deployments measured one after another{% endif %}{% if summary.run.vllm_patches %}
· cartspec's patches in vLLM: {% for name, status in summary.run.vllm_patches.items() %}{{ name }} {{ status }}{% if not loop.last %}, {% endif %}{% endfor %}{% endif %}</p>

<h2>Verdict</h2>
<p class="verdict" id="verdict">{{ verdict }}</p>

<h2>Beside the published study</h2>
<p class="muted">PayPal Commerce Agent: llama3.1-nemotron-nano-8B + LoRA, EAGLE-3 on vLLM, 2×H100. Ours: this machine, this run.</p>
<table id="published"><tr><th class="l">finding</th><th class="l">published</th><th class="l">this run</th></tr>
{% for c in comparison %}<tr><td class="l">{{ c.finding }}</td><td class="l">{{ c.published }}</td><td class="l">{{ c.ours }}</td></tr>{% endfor %}
</table>

<h2>Plots</h2>
{% for f in figures %}<figure id="fig-{{ f.id }}"><img class="plot" alt="{{ f.title }}" src="{{ f.src }}">
<figcaption><b>{{ f.title }}.</b> {{ f.caption }}</figcaption></figure>
{% else %}<p class="failed">No point was measured successfully: nothing to plot.</p>{% endfor %}

<h2>Capacity under the {{ slo }} s E2EL SLO</h2>
<p>Capacity: the highest goodput (requests/s meeting the SLO) one instance reached over the loads measured.
{% if target %}Instances needed for a target load of <b>{{ "%.2f"|format(target) }} req/s</b>
(default: twice the baseline's capacity — the study's "one GPU instead of two" question).{% endif %}</p>
<table id="capacity"><tr><th class="l">deployment</th><th>T</th><th class="l">request set</th><th>capacity (req/s)</th>
<th>at load</th><th>SLO attainment there</th><th>E2EL p99 there (s)</th><th>instances for target</th></tr>
{% for c in caps %}<tr><td class="l">{{ c.deployment }}</td><td>{{ c.temperature }}</td><td class="l">{{ c.request_set }}</td>
<td>{{ "%.3f"|format(c.capacity_rps) }}</td><td>{{ c.at_load }}</td><td>{{ pct(c.slo_attainment) }}</td>
<td>{{ num(c.e2el_p99, 2) }}</td><td>{{ c.instances_needed if c.instances_needed is not none else "—" }}</td></tr>{% endfor %}
</table>

{% if tests and not quality_html %}<h2>Quality: speculative replies against the baseline's</h2>
<p class="muted">Each deployment's replies paired with the baseline's to the same requests at the same loads.
Same text / same JSON: identical reply, or equal once parsed. Δ exact: the difference in exact match against the gold
answers, with a 95% bootstrap interval over requests (a request answered at several loads counts once) and an exact
sign-test p-value. Preserved: the interval lies inside ±{{ pct(tests[0].margin) }} (the quality step's equivalence
test; <code>cartspec quality --run DIR</code> adds every metric and the judge, in a table that replaces this one).</p>
<table id="quality"><tr><th class="l">deployment</th><th>T</th><th class="l">set</th><th>pairs</th><th>requests</th>
<th>same text</th><th>same JSON</th><th>exact, baseline</th><th>exact, speculative</th><th>Δ exact</th><th>95% CI</th>
<th>p</th><th class="l">verdict</th></tr>
{% for t in tests %}<tr><td class="l">{{ t.deployment }}</td><td>{{ t.temperature }}</td><td class="l">{{ t.request_set }}</td>
<td>{{ t.pairs }}</td><td>{{ t.requests }}</td><td>{{ pct(t.exact_text) }}</td><td>{{ pct(t.same_parsed) }}</td>
<td>{{ pct(t.accuracy_baseline) }}</td><td>{{ pct(t.accuracy_candidate) }}</td><td>{{ "%+.1f%%"|format(100 * t.diff) }}</td>
<td>[{{ "%+.1f"|format(100 * t.diff_ci95[0]) }}, {{ "%+.1f"|format(100 * t.diff_ci95[1]) }}]</td>
<td>{{ "%.2g"|format(t.mcnemar_p) }}</td>
<td class="l {{ 'good' if t.verdict == 'preserved' else 'bad' if t.verdict == 'worse' else '' }}">{{ t.verdict }}</td></tr>{% endfor %}
</table>{% endif %}
{{ quality_html }}

<h2>All points</h2>
<p class="muted">Throughput in output tokens/s; latencies in seconds (TPOT and ITL in ms). Speedup = output throughput
/ baseline's at the same load, temperature and request set. ITL is per streamed chunk (several tokens may share one).
JSON ok, exact: the replies' JSON validity and exact match against the gold answers; = baseline: at T=0, the share
of replies identical to the baseline's for the same request.</p>
<table id="points"><tr><th class="l">deployment</th><th>load</th><th>T</th><th class="l">set</th><th>req</th><th>err</th>
<th>tok/s</th><th>speedup</th><th>TTFT p50</th><th>TPOT p50</th><th>ITL p50</th><th>E2EL p50</th><th>E2EL p99</th>
<th>goodput</th><th>accept</th><th>τ</th><th>JSON ok</th><th>exact</th><th>= baseline</th></tr>
{% for r in rows %}{% if r.status == "ok" %}<tr><td class="l">{{ r.deployment }}</td>
<td>{{ r.concurrency if r.mode == "closed" else r.rate ~ "/s" }}</td><td>{{ r.temperature }}</td><td class="l">{{ r.request_set }}</td>
<td>{{ r.n_requests }}</td><td>{{ r.n_errors }}</td><td>{{ num(r.output_throughput, 1) }}</td>
<td class="{{ '' if r.method == 'none' else 'good' if r.speedup_vs_baseline and r.speedup_vs_baseline > 1 else 'bad' if r.speedup_vs_baseline else '' }}">{{ num(r.speedup_vs_baseline, 2) }}{% if r.speedup_ci95 %} <small>[{{ num(r.speedup_ci95[0], 2) }}–{{ num(r.speedup_ci95[1], 2) }}]</small>{% endif %}</td>
<td>{{ num(r.ttft_p50, 3) }}</td><td>{{ ms(r.tpot_p50) }}</td><td>{{ ms(r.itl_p50) }}</td><td>{{ num(r.e2el_p50, 2) }}</td>
<td>{{ num(r.e2el_p99, 2) }}</td><td>{{ num(r.goodput, 3) }}</td><td>{{ pct(r.acceptance_rate) }}</td><td>{{ num(r.tau, 2) }}</td>
<td>{{ pct(r.json_valid) }}</td><td>{{ pct(r.exact_match) }}</td><td>{{ pct(r.agreement_vs_baseline) }}</td></tr>
{% endif %}{% endfor %}</table>

{% set stepped = rows|selectattr("verify_ms")|list %}{% if stepped %}<h2>Where an engine step's time goes</h2>
<p class="muted">Per engine step, from cartspec's counters inside vLLM: drafting (the head's forwards and cartspec's
drafters) and the rest (the target's forward over the drafts, sampling, verification), in ms. Prefill: of the tokens
the target ran, the prompts' share; in time, the share of the steps' time spent in steps that prefilled a prompt.
Such a step also decodes the other requests in the batch; fixed: the part of the time no τ can shorten (what the
prompts add to their steps, and each request's first step, shared by the batch). The higher it is, the less a better
draft can speed up the point. Decoding step: the ms of a step that prefilled nothing, the cost a draft's τ divides.
A full draft: for a head or the hybrid at a fixed γ, the speed-up over the point if every drafted token were accepted
(τ = γ + 1), with the point's step costs and its fixed share: the most a better draft at this γ can add.</p>
<table id="steps"><tr><th class="l">deployment</th><th>load</th><th>T</th><th class="l">set</th><th>drafting ms</th>
<th>rest ms</th><th>prefill</th><th>prefill, in time</th><th>fixed, in time</th><th>decoding step ms</th><th>a full draft</th></tr>
{% for r in stepped %}<tr><td class="l">{{ r.deployment }}</td>
<td>{{ r.concurrency if r.mode == "closed" else r.rate ~ "/s" }}</td><td>{{ r.temperature }}</td><td class="l">{{ r.request_set }}</td>
<td>{{ num(r.draft_ms, 1) }}</td><td>{{ num(r.verify_ms, 1) }}</td><td>{{ pct(r.prefill_share) }}</td>
<td>{{ pct(r.prefill_time_share) }}</td><td>{{ pct(r.fixed_time_share) }}</td><td>{{ num(r.decode_ms, 1) }}</td>
<td>{% if r.draft_headroom %}×{{ num(r.draft_headroom, 2) }}{% else %}–{% endif %}</td></tr>
{% endfor %}</table>

{% endif %}{% set failed = rows|selectattr("status", "equalto", "failed")|list %}
{% if failed %}<h2 class="failed">Failed points</h2>
<table id="failed"><tr><th class="l">deployment</th><th>load</th><th>T</th><th class="l">reason</th></tr>
{% for r in failed %}<tr><td class="l">{{ r.deployment }}</td><td>{{ r.concurrency or r.rate }}</td><td>{{ r.temperature }}</td>
<td class="l"><pre style="white-space:pre-wrap;margin:0">{{ r.reason }}</pre></td></tr>{% endfor %}</table>{% endif %}

{% if adaptive %}<h2>Adaptive drafting beside the best fixed deployment</h2>
<p>{% set scheduled = adaptive | rejectattr("draft_stop") | list %}{% set cut = adaptive | selectattr("draft_stop") | list %}{% if scheduled %}γ per batch size, tuned for this machine ({% for a in scheduled[:1] %}schedule <code>{{ a.schedule }}</code>: [first batch size, last, γ]{% endfor %}).
{% endif %}{% if cut %}A draft cut per request ({% for a in cut[:1] %}θ {{ a.draft_stop }}{% endfor %}: each request's draft stops where the head's path probability falls below the threshold; no schedule, γ is the longest draft).
{% endif %}Goal at every load: ≥ 0.95 × the best fixed deployment and ≥ 1.0 × the baseline.{% if adaptive | selectattr("vs_best_fixed_ci95") | list %}
Brackets: 95% interval from the point's slices, each measured beside the other deployment's (seconds apart, the same requests);
"within noise": missed, but both intervals reach the goal.{% endif %}
"× same γ": over the fixed deployment that runs the γ the schedule runs at that load (the baseline at γ = 0): two servers
drafting alike, so that ratio shows how far two servers doing the same work measure apart in this run.</p>
<table id="adaptive"><tr><th class="l">deployment</th><th>T</th><th>load</th><th>γ there</th><th>tok/s</th>
<th class="l">best fixed</th><th>its tok/s</th><th>× best fixed</th><th>× baseline</th><th>goal</th><th>× same γ</th></tr>
{% for a in adaptive %}<tr><td class="l">{{ a.deployment }}</td><td>{{ a.temperature }}</td><td>{{ a.concurrency }}</td>
<td>{{ "per request" if a.draft_stop else a.gamma_at_load }}</td><td>{{ num(a.output_throughput, 1) }}</td><td class="l">{{ a.best_fixed }}</td>
<td>{{ num(a.best_fixed_throughput, 1) }}</td><td>{{ num(a.vs_best_fixed, 2) }}{% if a.vs_best_fixed_ci95 %} [{{ num(a.vs_best_fixed_ci95[0], 2) }}–{{ num(a.vs_best_fixed_ci95[1], 2) }}]{% endif %}</td>
<td>{{ num(a.vs_baseline, 2) }}{% if a.vs_baseline_ci95 %} [{{ num(a.vs_baseline_ci95[0], 2) }}–{{ num(a.vs_baseline_ci95[1], 2) }}]{% endif %}</td>
<td class="{{ 'good' if a.meets else ('' if a.within_noise else 'bad') }}">{{ "met" if a.meets else ("within noise" if a.within_noise else "missed") }}</td>
<td>{% if a.same_gamma %}{{ num(a.vs_same_gamma, 2) }}{% if a.vs_same_gamma_ci95 %} [{{ num(a.vs_same_gamma_ci95[0], 2) }}–{{ num(a.vs_same_gamma_ci95[1], 2) }}]{% endif %} ({{ a.same_gamma }}){% else %}–{% endif %}</td></tr>{% endfor %}</table>{% endif %}

{% if pairs %}<h2>The hybrid beside its head: τ into speed</h2>
<p>Each hybrid point over the head alone at the same γ and load (the same head, temperature and request set). A reply's
decoding steps fall as τ rises; a request's first step, and what a prefilling step costs above a decoding step, do not:
s, "fixed, in time", is that share of the head's step time. "Attainable": the ratio the τ gain would give with equal
step costs, s kept as it was: 1 / ((1 − s) / (τ ratio) + s).
"Kept": the share of that gain the hybrid kept, (ratio − 1) / (attainable − 1); its own work per step is the difference
in drafting ms. Goal: 1 + 0.8 × (τ ratio − 1), as if every step decoded; "out of reach" where it is above the attainable
ratio.{% if pairs | selectattr("ratio_ci95") | list %} Brackets: 95% interval from the point's slices.{% endif %}</p>
<table id="pairs"><tr><th class="l">hybrid</th><th class="l">head alone</th><th>T</th><th>load</th><th>τ / head's</th>
<th>τ ratio</th><th>× head</th><th>goal</th><th>fixed, in time</th><th>attainable</th><th>kept</th>
<th>drafting ms / head's</th><th>decoding step ms / head's</th></tr>
{% for p in pairs %}<tr><td class="l">{{ p.deployment }}</td><td class="l">{{ p.head_deployment }}</td><td>{{ p.temperature }}</td>
<td>{{ p.concurrency if p.mode == "closed" else p.rate ~ "/s" }}</td><td>{{ num(p.tau, 2) }} / {{ num(p.head_tau, 2) }}</td>
<td>{{ num(p.tau_ratio, 3) }}</td><td>{{ num(p.ratio, 3) }}{% if p.ratio_ci95 %} [{{ num(p.ratio_ci95[0], 2) }}–{{ num(p.ratio_ci95[1], 2) }}]{% endif %}</td>
<td class="{{ 'good' if p.meets_goal else ('' if p.goal_attainable == false else 'bad') }}">{{ num(p.goal, 3) }} {{ "met" if p.meets_goal else ("out of reach" if p.goal_attainable == false else "missed") }}</td>
<td>{{ pct(p.fixed_time_share) }}</td><td>{{ num(p.attainable, 3) }}</td><td>{{ pct(p.kept) }}</td>
<td>{{ num(p.draft_ms, 1) }} / {{ num(p.head_draft_ms, 1) }}</td><td>{{ num(p.decode_ms, 1) }} / {{ num(p.head_decode_ms, 1) }}</td></tr>{% endfor %}</table>

{% endif %}{{ by_class_html }}
<h2>Cost model of this machine</h2>
{% if cost.fitted %}<p>Each decode step with b sequences drafting γ tokens costs s = α + β·b·(γ+1) + γ·(δ + ε·b) and
advances each sequence by τ = 1 + Σ<sub>i≤γ</sub> p<sub>i</sub> tokens; each request's prompt costs π per token. So
1/throughput = s/(b·τ) + π·P/n<sub>out</sub>, fitted (non-negative least squares on relative error) to
{{ cost.n_points }} points, b being the mean number of requests in flight. α = {{ "%.2f"|format(1000 * cost.coefficients.alpha) }} ms,
β = {{ "%.3f"|format(1000 * cost.coefficients.beta) }} ms, δ = {{ "%.2f"|format(1000 * cost.coefficients.delta) }} ms,
ε = {{ "%.3f"|format(1000 * cost.coefficients.epsilon) }} ms, π = {{ "%.3f"|format(1000 * cost.coefficients.pi) }} ms.
Median absolute error {{ pct(cost.median_abs_error) }} in-sample, {{ pct(cost.loo_median_abs_error) }} leave-one-out
(each point predicted by a fit without it). <code>cartspec tune</code> picks γ per batch size from this model.</p>
{% if cost_plot %}<figure id="fig-cost-model"><img class="plot" alt="Cost model: predicted vs measured" src="{{ cost_plot }}">
<figcaption><b>Predicted vs measured output throughput.</b> On the grey line the model is exact.</figcaption></figure>{% endif %}
<table id="cost-model"><tr><th class="l">deployment</th><th>load</th><th>T</th><th>batch in flight</th>
<th>measured tok/s</th><th>predicted</th><th>error</th></tr>
{% for p in cost.points %}<tr><td class="l">{{ p.deployment }}</td><td>{{ p.concurrency }}</td><td>{{ p.temperature }}</td>
<td>{{ num(p.batch, 1) }}</td><td>{{ num(p.measured, 1) }}</td><td>{{ num(p.predicted, 1) }}</td>
<td>{{ "%+.1f%%"|format(100 * p.error) }}</td></tr>{% endfor %}</table>
{% else %}<p class="muted" id="cost-model">Not fitted: {{ cost.reason or "no points" }}.</p>{% endif %}

<h2>Definitions</h2>
<table>{% for k, v in summary.definitions.items() %}<tr><td class="l"><b>{{ k }}</b></td><td class="l">{{ v }}</td></tr>{% endfor %}</table>
<p class="muted">Machine-readable: summary.json beside this file; every request: results.jsonl.
Plots rendered: <span id="render-check">not checked (JavaScript off)</span></p>
<script>
// Self-check used by the report test in headless Chromium: how many plots decoded.
window.addEventListener("load", function () {
  var imgs = document.querySelectorAll("img.plot"), n = 0;
  imgs.forEach(function (i) { if (i.complete && i.naturalWidth > 0) n++; });
  document.getElementById("render-check").textContent = n + "/" + imgs.length;
});
</script>
</body></html>
"""


def _num(v: Any, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _pct(v: Any) -> str:
    return "—" if v is None else f"{v:.1%}"


def _ms(v: Any) -> str:
    return "—" if v is None else f"{1000 * v:.1f}"


def render_html(**ctx: Any) -> str:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.ChainableUndefined)
    env.globals.update(num=_num, pct=_pct, ms=_ms)
    return env.from_string(TEMPLATE).render(**ctx)
