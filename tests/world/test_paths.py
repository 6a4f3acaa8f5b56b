"""One rule for where the cache lives (agent/world/paths.py cache_root), read the same by every user of it."""
from pathlib import Path

import pytest

from agent.world import checkout, paths


@pytest.mark.parametrize("value", [None, ""])
def test_an_unset_or_empty_cache_variable_means_the_home_cache(monkeypatch, tmp_path, value):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    if value is None:
        monkeypatch.delenv("NIGHTSHIFT_CACHE", raising=False)
    else:
        monkeypatch.setenv("NIGHTSHIFT_CACHE", value)
    assert paths.cache_root() == tmp_path / "home" / ".cache" / "nightshift"  # never the working folder
    assert checkout.default_checkout_path("0.32.0").parent == paths.cache_root()


def test_a_set_cache_variable_is_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("NIGHTSHIFT_CACHE", str(tmp_path / "c"))
    assert paths.cache_root() == tmp_path / "c"


def test_every_reader_of_the_cache_variable_asks_cache_root():
    """Only agent/world/paths.py reads NIGHTSHIFT_CACHE among the package's modules."""
    root = Path(__file__).resolve().parents[2]
    readers = [p.relative_to(root).as_posix() for folder in ("agent", "sandbox", "traces")
               for p in (root / folder).rglob("*.py") if 'environ.get("NIGHTSHIFT_CACHE"' in p.read_text()
               or "environ['NIGHTSHIFT_CACHE'" in p.read_text() or 'environ["NIGHTSHIFT_CACHE"]' in p.read_text()]
    assert readers == ["agent/world/paths.py"]
