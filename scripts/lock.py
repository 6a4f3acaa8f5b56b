#!/usr/bin/env python3
"""Writes constraints.txt: every package a fresh install of nightshift resolves to, pinned.

`scripts/install.sh` (and so CI, `.ci/run`) installs with `-c constraints.txt`, so a new machine gets the
versions the suite last passed with, whatever PyPI has released since. To move the pins forward:

    python3 scripts/lock.py          # resolve afresh (pip's resolver, nothing installed), rewrite the file
    bash scripts/install.sh test && bash scripts/test.sh   # then commit constraints.txt if the suite passes

`python3 scripts/lock.py --check` exits 1, naming the packages, where the installed versions differ from the pins.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILE = ROOT / "constraints.txt"
EXTRAS = "cpu,test,ray,gpu"
HEADER = f"""\
# Every package a fresh `pip install -e ".[{EXTRAS}]"` resolved to, pinned: scripts/install.sh and CI
# install with -c constraints.txt. Written by scripts/lock.py (Linux x86_64, CPython 3.11); to move forward,
# run `python3 scripts/lock.py`, then the suite, and commit this file.
"""


def resolve() -> dict[str, str]:
    """{name: version} of what pip would install into an empty environment, from pip's own report."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", str(report), "-e", f".[{EXTRAS}]"], cwd=ROOT, check=True)
        items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items
            if i["metadata"]["name"].lower() != "nightshift"}


def pins(path: Path = FILE) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[name.strip().lower()] = version.strip()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare the installed versions with the pins")
    args = parser.parse_args()
    if args.check:
        off = []
        for name, version in sorted(pins().items()):
            try:
                have = metadata.version(name)
            except metadata.PackageNotFoundError:
                continue  # an extra not installed here (the GPU's, or torchvision removed after install)
            if have != version:
                off.append(f"{name}: installed {have}, pinned {version}")
        print("\n".join(off) or f"every installed package matches {FILE.name}")
        return 1 if off else 0
    resolved = resolve()
    FILE.write_text(HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(resolved.items())))
    print(f"{FILE.name}: {len(resolved)} packages pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
