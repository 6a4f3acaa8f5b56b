"""SEARCH/REPLACE blocks: parsing, exact application on a real file tree, and diffs `git apply` takes."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agent.proposers.edits import EditError, apply_edits, make_patch, normalize_path, parse_edits, surface_allows

INCLUDE, EXCLUDE = ["vllm/v1/*"], ["vllm/v1/secret/*"]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    (root / "vllm/v1").mkdir(parents=True)
    (root / "vllm/v1/a.py").write_text("import os\n\n\ndef f(x):\n    return x + 1\n\n\ndef g(x):\n    return x + 1\n")
    (root / "vllm/v1/tail.py").write_text("A = 1\nB = 2")  # no newline at the end
    return root


def block(path: str, search: str, replace: str) -> str:
    return f"{path}\n<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n"


def git_apply(root: Path, diff: str) -> None:
    (root / "p.diff").write_text(diff)
    subprocess.run(["git", "apply", "--unsafe-paths", "p.diff"], cwd=root, check=True, capture_output=True)
    (root / "p.diff").unlink()


def test_parse_fenced_and_bare_blocks_and_path_forms():
    text = ("SUMMARY: two things\n\n```python\nvllm/v1/a.py\n<<<<<<< SEARCH\nx\n=======\ny\n>>>>>>> REPLACE\n```\n\n"
            "**File: `vllm/v1/b.py`**\n```\n<<<<<<< SEARCH\np\n=======\nq\n>>>>>>> REPLACE\n```\n"
            "<<<<<<< SEARCH\nr\n=======\ns\n>>>>>>> REPLACE\n")
    edits = parse_edits(text)
    assert [(e.path, e.search, e.replace) for e in edits] == [
        ("vllm/v1/a.py", "x\n", "y\n"), ("vllm/v1/b.py", "p\n", "q\n"), ("vllm/v1/b.py", "r\n", "s\n")]


@pytest.mark.parametrize("text, message", [
    ("", "empty: the answer is empty"),
    ("Use a GPU.", "parse: no SEARCH/REPLACE block"),
    ("vllm/v1/a.py\n<<<<<<< SEARCH\nx\n", "parse: line 2: SEARCH block for vllm/v1/a.py is not closed"),
    ("vllm/v1/a.py\n<<<<<<< SEARCH\nx\n=======\ny\n", "parse: line 2: block for vllm/v1/a.py has no '>>>>>>> REPLACE'"),
    ("Here is my change:\n<<<<<<< SEARCH\nx\n=======\ny\n>>>>>>> REPLACE\n", "parse: line 2: a SEARCH block without a file path"),
])
def test_unparseable_answers(text, message):
    with pytest.raises(EditError) as info:
        parse_edits(text)
    assert str(info.value).startswith(message)


def test_apply_exactly_and_the_diff_applies_with_git(tree):
    text = block("vllm/v1/a.py", "def f(x):\n    return x + 1\n", "def f(x):\n    return x + 2\n")
    patch = make_patch(text, tree, INCLUDE, EXCLUDE)
    assert patch.files == ["vllm/v1/a.py"]
    assert patch.diff.startswith("diff --git a/vllm/v1/a.py b/vllm/v1/a.py\n--- a/vllm/v1/a.py\n+++ b/vllm/v1/a.py\n")
    before = (tree / "vllm/v1/a.py").read_text()
    git_apply(tree, patch.diff)
    assert (tree / "vllm/v1/a.py").read_text() == before.replace("x + 1\n\n\ndef g", "x + 2\n\n\ndef g")


def test_the_checkout_is_only_read(tree):
    before = {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()}
    make_patch(block("vllm/v1/a.py", "import os\n", "import sys\n"), tree, INCLUDE, EXCLUDE)
    assert before == {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()}


def test_ambiguous_mismatch_indentation_and_noop(tree):
    with pytest.raises(EditError, match="ambiguous: block 1: the SEARCH text occurs 2 times") as info:
        make_patch(block("vllm/v1/a.py", "    return x + 1\n", "    return x\n"), tree, INCLUDE, EXCLUDE)
    assert "(lines 5: 'return x + 1', 9: 'return x + 1'); include more lines" in str(info.value)
    with pytest.raises(EditError, match="occurs 2 times in vllm/v1/a.py \\(lines 4: 'def f\\(x\\):', 8: 'def g"):
        make_patch(block("vllm/v1/a.py", "(x):\n", "(y):\n"), tree, INCLUDE, EXCLUDE)  # mid-line: its whole line
    with pytest.raises(EditError, match="match: .* matches line 1 only up to indentation"):
        make_patch(block("vllm/v1/a.py", "  import os\n", "  import sys\n"), tree, INCLUDE, EXCLUDE)
    with pytest.raises(EditError, match="noop: the edits change nothing"):
        make_patch(block("vllm/v1/a.py", "import os\n", "import os\n"), tree, INCLUDE, EXCLUDE)
    with pytest.raises(EditError, match="match: block 1: vllm/v1/missing.py does not exist"):
        make_patch(block("vllm/v1/missing.py", "x\n", "y\n"), tree, INCLUDE, EXCLUDE)


def test_a_file_without_a_final_newline(tree):
    patch = make_patch(block("vllm/v1/tail.py", "B = 2\n", "B = 3\n"), tree, INCLUDE, EXCLUDE)
    git_apply(tree, patch.diff)
    assert (tree / "vllm/v1/tail.py").read_text() == "A = 1\nB = 3"


def test_new_file_and_sequential_blocks_on_one_file(tree):
    text = (block("vllm/v1/new.py", "", "X = 1\n")
            + block("vllm/v1/a.py", "import os\n", "import os\nimport sys\n")
            + block("vllm/v1/a.py", "import sys\n", "import sys  # twice edited\n"))
    patch = make_patch(text, tree, INCLUDE, EXCLUDE)
    assert "new file mode 100644" in patch.diff and patch.files == ["vllm/v1/a.py", "vllm/v1/new.py"]
    git_apply(tree, patch.diff)
    assert (tree / "vllm/v1/new.py").read_text() == "X = 1\n"
    assert (tree / "vllm/v1/a.py").read_text().startswith("import os\nimport sys  # twice edited\n")
    with pytest.raises(EditError, match="empty SEARCH for vllm/v1/a.py, which already exists"):
        make_patch(block("vllm/v1/a.py", "", "boom\n"), tree, INCLUDE, EXCLUDE)


@pytest.mark.parametrize("path, code", [
    ("../outside.py", "path"), ("/etc/passwd", "path"), ("vllm/../../x.py", "path"), (".git/config", "path"),
    ("vllm/v1/secret/k.py", "surface"), ("benchmarks/bench.py", "surface"), ("vllm/entrypoints/x.py", "surface"),
])
def test_paths_outside_the_checkout_or_surface(tree, path, code):
    with pytest.raises(EditError) as info:
        make_patch(block(path, "x\n", "y\n"), tree, INCLUDE, EXCLUDE)
    assert info.value.code == code


def test_a_symlink_out_of_the_checkout_is_refused(tree, tmp_path):
    (tmp_path / "elsewhere.py").write_text("x\n")
    (tree / "vllm/v1/link.py").symlink_to(tmp_path / "elsewhere.py")
    with pytest.raises(EditError, match="path: vllm/v1/link.py resolves outside the checkout"):
        apply_edits(parse_edits(block("vllm/v1/link.py", "x\n", "y\n")), tree, INCLUDE, EXCLUDE)


def test_path_helpers():
    assert normalize_path("a/vllm/v1/a.py") == "vllm/v1/a.py" and normalize_path("./vllm/x.py") == "vllm/x.py"
    assert surface_allows("vllm/v1/deep/er/x.py", INCLUDE, EXCLUDE)  # fnmatch: * also matches /
    assert not surface_allows("vllm/v1/secret/x.py", INCLUDE, EXCLUDE)


def test_markers_are_lenient_but_the_search_text_is_exact(tree):
    text = "vllm/v1/a.py\n<<< SEARCH\nimport os\n=======\nimport sys\n>>> REPLACE\n"
    assert [(e.search, e.replace) for e in parse_edits(text)] == [("import os\n", "import sys\n")]
    text = "vllm/v1/a.py\nSEARCH\nimport os\n=======\nimport sys\nREPLACE\n"
    assert make_patch(text, tree, INCLUDE, EXCLUDE).files == ["vllm/v1/a.py"]
    with pytest.raises(EditError, match="match:"):
        make_patch("vllm/v1/a.py\nSEARCH\nimport  os\n=======\nimport sys\nREPLACE\n", tree, INCLUDE, EXCLUDE)
    with pytest.raises(EditError, match="parse: no SEARCH/REPLACE block"):
        parse_edits("SEARCH/REPLACE\nimport os\n")


CLASSY = '''import functools


class Sampler:
    """Samples."""

    @functools.lru_cache(maxsize=None)
    def forward(self, x):
        return x + 1

    class Inner:
        def step(self):
            return 1


def forward(x):
    return x
'''


def test_a_method_is_replaced_whole_by_its_ast_with_decorators_and_indentation(tree):
    (tree / "vllm/v1/s.py").write_text(CLASSY)
    text = ("vllm/v1/s.py\n<<<<<<< FUNCTION Sampler.forward\n@functools.lru_cache(maxsize=None)\n"
            "def forward(self, x):\n    return x + 2\n>>>>>>> END\n"
            "<<<<<<< FUNCTION Sampler.Inner.step\n        def step(self):\n            return 2\n>>>>>>> END\n")
    patch = make_patch(text, tree, INCLUDE, EXCLUDE)
    git_apply(tree, patch.diff)
    after = (tree / "vllm/v1/s.py").read_text()
    assert after == CLASSY.replace("return x + 1", "return x + 2").replace("return 1", "return 2")
    assert [e.function for e in patch.edits] == ["Sampler.forward", "Sampler.Inner.step"]


@pytest.mark.parametrize("name, code, message", [
    ("Sampler.backward", "def backward(self):\n    pass\n", "has no function or method 'Sampler.backward'"),
    ("Sampler.forward", "def other(self, x):\n    return x\n", "must be exactly one definition of forward"),
    ("Sampler.forward", "def forward(self, x):\n    return (x\n", "the new definition of Sampler.forward does not parse"),
    ("Sampler.forward", "x = 1\ndef forward(self, x):\n    return x\n", "must be exactly one definition"),
])
def test_a_function_edit_that_can_not_apply_says_why(tree, name, code, message):
    (tree / "vllm/v1/s.py").write_text(CLASSY)
    with pytest.raises(EditError, match="function: ") as info:
        make_patch(f"vllm/v1/s.py\n<<<<<<< FUNCTION {name}\n{code}>>>>>>> END\n", tree, INCLUDE, EXCLUDE)
    assert message in str(info.value)


def test_the_module_level_function_of_the_same_name_is_its_own(tree):
    (tree / "vllm/v1/s.py").write_text(CLASSY)
    patch = make_patch("vllm/v1/s.py\n<<<<<<< FUNCTION forward\ndef forward(x):\n    return -x\n>>>>>>> END\n",
                       tree, INCLUDE, EXCLUDE)
    removed = [line for line in patch.diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert removed == ["-    return x"] and "@@ -14,4 +14,4 @@" in patch.diff


def test_a_file_that_does_not_exist_is_answered_with_the_closest_ones_inside_the_surface(tree):
    (tree / "vllm/v1/layernorm.py").write_text("def norm(x):\n    return x\n")
    (tree / "vllm/entrypoints").mkdir()
    (tree / "vllm/entrypoints/layernorm.py").write_text("X = 1\n")  # outside the surface: never suggested
    with pytest.raises(EditError, match="does not exist in the checkout") as info:
        make_patch(block("vllm/v1/layer_norm.py", "def norm(x):\n", "def norm(y):\n"), tree, INCLUDE, EXCLUDE)
    assert str(info.value).endswith("did you mean vllm/v1/layernorm.py?")
    with pytest.raises(EditError, match="did you mean vllm/v1/layernorm.py") as info:
        make_patch("vllm/v1/layer_norm.py\n<<<<<<< FUNCTION norm\ndef norm(y):\n    return y\n>>>>>>> END\n",
                   tree, INCLUDE, EXCLUDE)
    assert "entrypoints" not in str(info.value)
    with pytest.raises(EditError, match="does not exist in the checkout$"):  # nothing close: no hint
        make_patch(block("vllm/v1/zzzz_qqqq_wwww.py", "x\n", "y\n"), tree, INCLUDE, EXCLUDE)
