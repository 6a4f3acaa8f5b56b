"""A patchable vLLM checkout: a git repo of the installed vLLM's sources, compiled parts untracked."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import git

from agent.world.paths import cache_root
from traces.errors import NightshiftError

COMPILED_SUFFIXES = (".so", ".pyd", ".dylib")
FIXED_DATE = "2000-01-01T00:00:00+0000"
"""The checkout's one commit is dated so that the same installed vLLM gives the same commit on every host: a run
moved to another host (agent/run/move.py) finds its base commit in a checkout made there."""
IGNORED = ["*.so", "*.pyd", "*.dylib", "__pycache__/", "*.pyc", "/*.dist-info/", "/.nightshift/"]


class CheckoutError(NightshiftError, RuntimeError):
    stage = "checkout"


def installed_vllm() -> tuple[Path, str]:
    """(the installed vllm package folder, its version)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        raise CheckoutError("vLLM is not installed in this Python (pip install 'nightshift[cpu]')")
    package = Path(spec.origin).parent
    version = version_in(package)
    if not version:
        raise CheckoutError(f"cannot read the vLLM version from {package / '_version.py'}")
    return package, version


def version_in(package: Path) -> str:
    """The version a vllm package folder's _version.py writes (without a local `+...` suffix), or "" where it has
    none or the file does not run."""
    version_file = Path(package) / "_version.py"
    namespace: dict = {}
    if version_file.is_file():
        try:
            exec(compile(version_file.read_text(), str(version_file), "exec"), namespace)
        except Exception:  # noqa: BLE001 a version file that does not run writes no version
            return ""
    return str(namespace.get("__version__") or namespace.get("version") or "").split("+")[0]


def default_checkout_path(version: str) -> Path:
    return cache_root() / f"vllm-{version}"


def version_tag(version: str) -> str:
    return f"v{version}"


def create_checkout(dest: Path | None = None) -> tuple[Path, str]:
    """Build (or reuse) a git repo of the installed vLLM's Python sources, tagged with its version."""
    package, version = installed_vllm()
    dest = Path(dest or default_checkout_path(version))
    if (dest / ".git").exists():
        repo = git.Repo(dest)
        if version_tag(version) not in [t.name for t in repo.tags]:
            raise CheckoutError(f"{dest} is a git repo without tag {version_tag(version)}")
        return dest, version
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(package, staging / "vllm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", *[f"*{s}" for s in COMPILED_SUFFIXES]))
    (staging / ".gitignore").write_text("\n".join(IGNORED) + "\n")
    repo = git.Repo.init(staging, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "nightshift")
        config.set_value("user", "email", "nightshift@localhost")
    repo.git.add("-A")
    repo.git.commit("-q", "-m", f"vLLM {version}: sources of the installed package",
                    env={"GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE})
    repo.create_tag(version_tag(version))
    staging.rename(dest)
    return dest, version


def open_checkout(path: Path, version: str) -> git.Repo:
    if not (Path(path) / ".git").exists():
        raise CheckoutError(f"{path} is not a git checkout (run `nightshift checkout` to make one)")
    repo = git.Repo(path)
    if version_tag(version) not in [t.name for t in repo.tags]:
        raise CheckoutError(f"{path} has no tag {version_tag(version)}; it must match the installed vLLM")
    if not (Path(path) / "vllm" / "__init__.py").is_file():
        raise CheckoutError(f"{path} has no vllm/__init__.py at its root")
    changed = [line[3:] for line in repo.git.status("--porcelain", "--untracked-files=no").splitlines()]
    if changed:
        raise CheckoutError(f"{path} has uncommitted changes ({', '.join(changed[:3])}"
                            f"{', ...' if len(changed) > 3 else ''}); commit or discard them: a run starts "
                            f"from tag {version_tag(version)} and would ignore them")
    return repo
