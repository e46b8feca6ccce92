"""Rebuilds this fixture from a full study run: ``python make_fixture.py RUN_DIR``.

Keeps baseline, eagle3-domain-g3 and the adaptive eagle3-domain-auto at c=1 and c=8, T=0 and T=0.5, the
first six request records of each point (aggregates are kept as measured), and adds one failed point
(eagle3-domain-g5). The lines are copied as JSON, so they keep the field names of the version that wrote
them. ``summary.before.json`` is the summary that version's report built from them.
"""

import json
import shutil
import sys
from pathlib import Path

KEEP = {"baseline", "eagle3-domain-g3", "eagle3-domain-auto"}
LOADS = {1, 8}
RECORDS = 6


def main(src: Path, dst: Path) -> None:
    rows = [json.loads(line) for line in (src / "results.jsonl").read_text().splitlines() if line.strip()]
    out, failed = [], None
    for row in rows:
        c = row["config"]
        if c["deployment"] == "eagle3-domain-g5" and failed is None and c["concurrency"] == 1:
            failed = {"schema_version": row["schema_version"], "key": row["key"], "config": c, "status": "failed",
                      "reason": "vLLM exited with code 1 before it was ready", "finished_at": row["finished_at"],
                      "deployment": row["deployment"], "machine": row["machine"]}
        if c["deployment"] not in KEEP or c["concurrency"] not in LOADS:
            continue
        row["records"] = row["records"][:RECORDS]
        out.append(row)
    out.append(failed)
    (dst / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))
    shutil.copy(src / "run.json", dst / "run.json")
    if (src / "quality.json").exists():
        shutil.copy(src / "quality.json", dst / "quality.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(__file__).parent)
