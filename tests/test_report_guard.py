"""The report guard (tests/report_guard.py): a failure whose rendering crashes is still a counted failure."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """The inner pytest runs in a subprocess of its own, which must find `tests.report_guard`."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

BROKEN_RENDERING = """
import _pytest._code.code as code
import _pytest._code.source as source

def crash(*args, **kwargs):
    raise SystemError("AST constructor recursion depth mismatch (before=147, after=164)")

source.getstatementrange_ast = code.getstatementrange_ast = crash
"""


@pytest.mark.parametrize("args", [[], ["-n", "1"]], ids=["in-process", "xdist"])
def test_a_failure_whose_rendering_crashes_is_reported_and_the_run_goes_on(pytester, args):
    pytester.makeconftest(BROKEN_RENDERING)
    pytester.makepyfile(test_inner="""
def test_fails():
    assert 1 + 1 == 3

def test_passes():
    assert True
""")
    result = pytester.runpytest_subprocess("-p", "tests.report_guard", *args)
    result.assert_outcomes(failed=1, passed=1)
    text = result.stdout.str()
    assert "INTERNALERROR" not in text
    assert "pytest could not render this failure (SystemError: AST constructor recursion" in text
    assert "assert 1 + 1 == 3" in text  # the native traceback still names the failing line


def test_without_the_guard_the_same_failure_crashes_the_runner(pytester):
    """The control: the crash the guard exists for is real in this pytest."""
    pytester.makeconftest(BROKEN_RENDERING)
    pytester.makepyfile(test_inner="def test_fails():\n    assert 1 + 1 == 3\n")
    result = pytester.runpytest_subprocess("-p", "no:tests.report_guard")
    assert "INTERNALERROR" in result.stdout.str() + result.stderr.str()
