"""`--samples K`: K replies per request, sample j of request i seeded alike on every deployment."""

from __future__ import annotations

import contextlib

from typer.testing import CliRunner

from cartspec.results import DeploymentInfo, PointConfig, load_results
from cartspec.bench.sweep import SweepPlan, parse_deployment, run_sweep
from cartspec.cli import app
from cartspec.paths import config_digest
from cartspec.testing.trivial_server import FakeConfig, TrivialServer


class _Started:
    def __init__(self, srv, spec):
        self.srv, self.spec = srv, spec

    @property
    def url(self):
        return self.srv.url

    def alive(self):
        return True

    def died_reason(self):
        return ""

    def describe(self):
        return DeploymentInfo(label=self.spec.label, method=self.spec.speculative.method, model="fake", url=self.url)


def test_samples_are_paired_by_seed_across_deployments(tmp_path):
    servers: dict[str, TrivialServer] = {}

    @contextlib.contextmanager
    def launch(spec, log_dir):
        with TrivialServer(FakeConfig(tokens=4, reply='{"intent": "search"}')) as srv:
            servers[spec.label] = srv
            yield _Started(srv, spec)

    plan = SweepPlan(deployments=[parse_deployment(d, "commerce") for d in ("baseline", "ngram:3")],
                     concurrencies=[2], temperatures=[0.5], n_requests=4, warmup=1, samples=3, seed=7)
    run_sweep(plan, tmp_path, launcher=launch)
    by = {r.config.deployment: r for r in load_results(tmp_path)}
    assert set(by) == {"baseline", "ngram-g3"}
    for r in by.values():
        assert r.status == "ok" and r.config.samples == 3 and r.n_requests == 12
        assert sorted((x.id, x.sample) for x in r.records) == [(f"test-{i:05d}", j) for i in range(4) for j in range(3)]
    # the warm-up's seed first, then request r sample j: seed * 100003 + 3r + j, the same on both
    for label, srv in servers.items():
        measured = srv.counters.seeds[1:]
        assert sorted(measured) == [7 * 100_003 + k for k in range(12)], label
    assert len({x.text for x in by["baseline"].records}) == 1


def test_a_point_without_samples_or_rounds_keeps_its_key():
    """Runs measured before --samples and --rounds existed resume: 1 of each leaves the digest as it was."""
    cfg = PointConfig(deployment="baseline", method="none", concurrency=1, n_requests=4)
    old = cfg.model_dump(mode="json")
    old.pop("samples")
    old.pop("rounds")
    assert cfg.key == config_digest(old)
    assert PointConfig(deployment="baseline", method="none", concurrency=1, n_requests=4, samples=2).key != cfg.key
    assert PointConfig(deployment="baseline", method="none", concurrency=1, n_requests=4, rounds=2).key != cfg.key


def test_study_runs_the_quality_tests_after_its_sweep(tmp_path):
    with TrivialServer(FakeConfig(tokens=4)) as srv:
        res = CliRunner().invoke(app, ["study", "--server", srv.url, "--out", str(tmp_path), "--concurrency", "1",
                                       "--requests", "3", "--samples", "2", "--temperatures", "0.5"])
    assert res.exit_code == 0, res.output
    # one deployment behind --server: nothing to compare with, and the study says so instead of failing
    assert "quality: not tested" in res.output
    (r,) = load_results(tmp_path)
    assert r.n_requests == 6 and {x.sample for x in r.records} == {0, 1}
