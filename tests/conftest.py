import importlib.util
import json
import os
import uuid
from pathlib import Path

import pytest

from tests import stand_in

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.report_guard", "tests.xdist_groups", "pytester"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """A test with the real vLLM holds the machine: it is `heavy` (one at a time), unless it is marked `contained`
    itself (one server's start and a completion, no speed measured: it runs beside the heavy tier); a Docker test
    without the real vLLM is `contained`. All are `slow` (left out by `scripts/test.sh --fast`). Marked before `-m`
    selects."""
    for item in items:
        if item.get_closest_marker("vllm"):
            if not item.get_closest_marker("contained"):
                item.add_marker(pytest.mark.heavy)
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("docker"):
            item.add_marker(pytest.mark.contained)
            item.add_marker(pytest.mark.slow)
    # Docker tests last (a stable sort: whole modules move, so no module fixture is built twice): CI builds the
    # sandbox image while the first tests run (.ci/run, `engine` waits for it). Before them, the modules whose
    # tests run longest first (PACED_LONGEST_FIRST)
    items.sort(key=lambda item: (item.get_closest_marker("docker") is not None, paced_rank(item)))


PACED_LONGEST_FIRST = ("tests/run/test_moved_by_code.py", "tests/stages/test_audit_rule.py",
                       "tests/run/test_incumbent_checked.py", "tests/run/test_parallel_resume.py",
                       "tests/run/test_loop_judgement.py")
"""The paced tier's modules with its longest tests (on 2 cores: the moved-by-code run about 120 s with three at once; at
-n 3, the audit rule's noisy runs 99, 87 and 53 s, the honest noisy incumbents 78 s, parallel resumes 40-93 s,
confirmations and null gates 45-58 s; the rest 20-40 s or less), in that order before every other module. pytest-xdist
hands out tests in collection order, a few ahead to each worker: collected last, as their paths sort, two of
them ran one after the other on one worker while the others had finished (the tier took 775 s for 1,991 s of tests on
three workers)."""


def paced_rank(item) -> int:
    path = item.nodeid.split("::")[0]
    return PACED_LONGEST_FIRST.index(path) if path in PACED_LONGEST_FIRST else len(PACED_LONGEST_FIRST)


def once_per_session(tmp_path_factory, name: str, produce):
    """produce()'s JSON value, made once for the whole pytest session: under pytest-xdist the first worker to ask
    makes it and the others wait for it and read it (a module fixture is otherwise built again on every worker that
    runs one of the module's tests: the parallel resume's uninterrupted run, a run on a local Ray instance, four times
    at `-n 4`)."""
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not session:
        return json.loads(json.dumps(produce()))
    from filelock import FileLock

    path = tmp_path_factory.getbasetemp().parent / f"{name}-{session}.json"
    with FileLock(f"{path}.lock"):
        if path.exists():
            return json.loads(path.read_text())
        value = json.loads(json.dumps(produce()))
        path.write_text(json.dumps(value))
        return value


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


IMAGE_BUILD_ENV = "NIGHTSHIFT_IMAGE_BUILD"
"""Set by .ci/run while scripts/docker-image.sh runs beside the tests: the folder where the build writes its log
(`log`) and, once it ends, its exit code (`rc`)."""


def wait_for_image_build(timeout_s: float = 1800) -> None:
    """Where the sandbox image is being built beside the tests, wait for the build to end; fail if it failed."""
    folder = os.environ.get(IMAGE_BUILD_ENV)
    if not folder:
        return
    import time

    rc, deadline = Path(folder) / "rc", time.monotonic() + timeout_s
    while not rc.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the sandbox image build beside the tests did not end in {timeout_s:.0f} s ({folder}/log)")
        time.sleep(2)
    if rc.read_text().strip() != "0":
        log = (Path(folder) / "log").read_text(errors="replace")[-3000:]
        pytest.fail(f"the sandbox image build failed (exit {rc.read_text().strip()}):\n{log}")


@pytest.fixture(scope="session")
def engine():
    """The Docker engine, with the sandbox image built (scripts/docker-engine.sh, scripts/docker-image.sh); skipped
    only when no engine answers."""
    from sandbox.docker_backend import DockerUnavailable, connect

    wait_for_image_build()
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


@pytest.fixture(scope="session")
def vllm_tree(tmp_path_factory, vllm_checkout):
    """A candidate tree as the loop builds one: a worktree with bytecode and linked compiled parts (read-only to the
    tests that serve it)."""
    import git

    from agent.stages.build import build

    tree = tmp_path_factory.mktemp("vllm-tree") / "baseline"
    git.Repo(vllm_checkout).git.worktree("add", "--detach", str(tree), "HEAD")
    build(0, tree, [])
    return tree


@pytest.fixture(scope="session")
def real_vllm_seed(tmp_path_factory) -> Path:
    """The caches `local_greedy_tokens`'s server exports (with tests/real_vllm.py's SEED_MARK), which the other
    backends' real-vLLM servers start from, as a run's candidates start from its baseline's."""
    from tests.real_vllm import SEED_MARK

    path = tmp_path_factory.mktemp("real-vllm-seed")
    (path / SEED_MARK).parent.mkdir(parents=True)
    (path / SEED_MARK).write_text("seeded\n")
    return path


@pytest.fixture(scope="session")
def local_greedy_tokens(tmp_path_factory, vllm_tree, nightshift_cache, real_vllm_seed) -> list[int]:
    """tests/real_vllm.py's greedy completion from real vLLM served by the local backend on vllm_tree: what every
    other backend must return too (one local server for all of them). Its caches go to `real_vllm_seed`."""
    from sandbox.local import LocalSandbox
    from tests.real_vllm import greedy_tokens, real_vllm_spec

    run_dir = tmp_path_factory.mktemp("local-greedy") / f"run-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir()
    sandbox = LocalSandbox(None, run_dir)
    server = sandbox.start(real_vllm_spec(vllm_tree, "real-vllm-local"))
    try:
        tokens = greedy_tokens(server)
        sandbox.export_cache(server, real_vllm_seed)
        return tokens
    finally:
        server.stop()


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


