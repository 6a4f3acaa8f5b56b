"""nightshift: unattended vLLM serving optimization that keeps only token-identical changes."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("nightshift")
except PackageNotFoundError:
    __version__ = "0.1.0"
