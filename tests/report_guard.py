"""A failure's report must never crash the test runner.

pytest renders a failure by reading each frame's source with `ast.parse`. On CPython 3.11.7 that can raise
`SystemError: AST constructor recursion depth mismatch` (CPython gh-106905) after a dependency failed deep in
its own calls (openai on httpx2 did); the error escapes pytest's reporting, and under xdist it ends the whole
tier as an INTERNALERROR with no test counted. This plugin renders such a failure again as a native
traceback (Python's own, no source parsing), says so in the report, and lets the run go on."""
import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    try:
        return (yield)
    except Exception as error:  # the report of this failure failed, not the test
        from _pytest.reports import TestReport

        option = item.config.option
        style = getattr(option, "tbstyle", "auto")
        option.tbstyle = "native"
        try:
            report = TestReport.from_item_and_call(item, call)
        finally:
            option.tbstyle = style
        report.sections.append(("report guard", f"pytest could not render this failure "
                                                f"({type(error).__name__}: {error}); shown as a native traceback"))
        return report
