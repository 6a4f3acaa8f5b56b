"""Packaging beyond pyproject.toml: the built-in tasks ship inside the package.

The project keeps its task files at the top (`tasks/*.yaml`, their model configs in `tasks/models/`); an installed
nightshift finds them as the data of `agent.world.builtin_tasks`, which this maps to that folder
(agent/world/task.py `builtin_tasks` and `find_task` look there, or at `tasks/` in a source checkout)."""
from setuptools import find_namespace_packages, setup

BUILTIN_TASKS = "agent.world.builtin_tasks"

setup(
    packages=find_namespace_packages(include=["agent*", "sandbox*", "traces*"], exclude=["*__pycache__"])
    + [BUILTIN_TASKS],
    package_dir={BUILTIN_TASKS: "tasks"},
    package_data={"": ["*.txt", "*.j2", "*.md", "*.yaml"], BUILTIN_TASKS: ["*.yaml", "models/*/*.json"]},
)
