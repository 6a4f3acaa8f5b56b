"""The LLM proposer's prompt templates (Python `string.Template`), one Markdown file each, loaded by name."""
from __future__ import annotations

from pathlib import Path
from string import Template

FOLDER = Path(__file__).resolve().parent


def load(name: str) -> Template:
    return Template((FOLDER / f"{name}.md").read_text())
