"""The README's picture of the report: build a stored run's report and photograph it in headless Chromium.

usage: .venv/bin/python scripts/report_picture.py [--run tests/data/study_v1] [--out docs/img/report.png]

The run is copied to a temporary directory first, so the stored run (a test fixture) is left as it was;
``cartspec report --run`` builds its report.html there, and Chromium (Debian: ``apt-get install -y
chromium``) screenshots it with the flags the report's browser test uses. Nothing is fetched: the report is
one self-contained file.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--virtual-time-budget=5000"]


def browser() -> str:
    """The first Chromium on PATH; exits with the install command when there is none."""
    found = next((shutil.which(n) for n in BROWSERS if shutil.which(n)), None)
    if found is None:
        sys.exit("no chromium on PATH: apt-get update && apt-get install -y chromium")
    return found


def picture(run: Path, out: Path, width: int, height: int) -> Path:
    """Rebuild ``run``'s report in a copy of it and write a ``width`` x ``height`` screenshot to ``out``."""
    chromium = browser()
    with tempfile.TemporaryDirectory(prefix="cartspec-picture-") as tmp:
        copy = Path(tmp) / run.name
        shutil.copytree(run, copy)
        built = subprocess.run([sys.executable, "-m", "cartspec.cli", "report", "--run", str(copy)],
                               capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"cartspec report failed:\n{built.stdout}{built.stderr}")
        html = copy / "report.html"
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([chromium, *FLAGS, f"--user-data-dir={Path(tmp) / 'profile'}",
                        f"--window-size={width},{height}", f"--screenshot={out.resolve()}", html.as_uri()],
                       check=True, capture_output=True, timeout=180)
    if not out.exists():
        sys.exit(f"chromium wrote no screenshot to {out}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, default=ROOT / "tests/data/study_v1", help="a study's run directory")
    p.add_argument("--out", type=Path, default=ROOT / "docs/img/report.png", help="the PNG to write")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=3000, help="pixels from the top: the verdict, the comparison and the first plots")
    a = p.parse_args()
    shot = picture(a.run, a.out, a.width, a.height)
    print(f"{shot} ({shot.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
