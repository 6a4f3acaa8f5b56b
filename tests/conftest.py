import importlib.util
import json
import os
import uuid
from pathlib import Path

import pytest

from tests import stand_in

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.report_guard", "pytester"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """A test with the real vLLM holds the machine: it is `heavy` (one at a time); a Docker test without it is
    `contained` (one at a time, beside the heavy tier). Both are `slow` (left out by `scripts/test.sh --fast`).
    Marked before `-m` selects."""
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.heavy)
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("docker"):
            item.add_marker(pytest.mark.contained)
            item.add_marker(pytest.mark.slow)


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def nightshift_cache(tmp_path_factory) -> Path:
    """One cache (synthetic checkpoints) per test session, unless NIGHTSHIFT_CACHE is set."""
    path = Path(os.environ.get("NIGHTSHIFT_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["NIGHTSHIFT_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def vllm_checkout(tmp_path_factory, nightshift_cache) -> Path:
    if not has_vllm():
        pytest.skip("vLLM is not installed (pip install -e '.[cpu]')")
    from agent.world.checkout import create_checkout

    path, _ = create_checkout(tmp_path_factory.mktemp("vllm") / "checkout")
    return path


SANDBOX_IMAGE = os.environ.get("NIGHTSHIFT_SANDBOX_IMAGE", "nightshift-sandbox:cpu")


@pytest.fixture(scope="session")
def engine():
    """The Docker engine, with the sandbox image built (scripts/docker-engine.sh, scripts/docker-image.sh); skipped
    only when no engine answers."""
    from sandbox.docker_backend import DockerUnavailable, connect

    try:
        client = connect()
    except DockerUnavailable as exc:
        pytest.skip(str(exc))
    if not client.images.list(name=SANDBOX_IMAGE):
        pytest.fail(f"the sandbox image {SANDBOX_IMAGE} is missing: build it with scripts/docker-image.sh")
    return client


@pytest.fixture
def run_dir(tmp_path):
    """A run folder of its own (sandboxes label what they start with it)."""
    path = tmp_path / f"run-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def vllm_tree(tmp_path_factory, vllm_checkout):
    """A candidate tree as the loop builds one: a worktree with bytecode and linked compiled parts."""
    import git

    from agent.stages.build import build

    tree = tmp_path_factory.mktemp("vllm-tree") / "baseline"
    git.Repo(vllm_checkout).git.worktree("add", "--detach", str(tree), "HEAD")
    build(0, tree, [])
    return tree


# The stand-in judging kit's fixtures (tests/stand_in.py)
@pytest.fixture(scope="module")
def fake_checkout(tmp_path_factory) -> Path:
    return stand_in.stand_in_checkout(tmp_path_factory.mktemp("fake-vllm") / "checkout")


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fake-model")
    (path / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    return path


@pytest.fixture
def run(tmp_path, fake_checkout, fake_model):
    return stand_in.loop_maker(tmp_path, fake_checkout, fake_model)


