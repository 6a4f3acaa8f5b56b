"""The package as a user installs it: a wheel (not an editable install) carries the built-in tasks and their model
configs, and `nightshift` finds them by name from any folder (agent/world/task.py find_task; setup.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.world.task import DEFAULT_TASK, TaskError, builtin_tasks, find_task, load_task

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "agent", "sandbox", "traces", "tasks")


def test_a_bare_name_is_a_builtin_task_and_a_path_is_a_path(tmp_path, monkeypatch):
    assert builtin_tasks() == ROOT / "tasks"  # a source checkout: the project's own folder
    assert find_task(DEFAULT_TASK) == ROOT / "tasks" / "gemma4-tiny-cpu.yaml"
    assert load_task("gemma4-e2b").model.synthetic.config == ROOT / "tasks" / "models" / "gemma-4-e2b" / "config.json"
    monkeypatch.chdir(tmp_path)
    assert find_task("gemma4-tiny-cpu.yaml") == Path("gemma4-tiny-cpu.yaml")  # a file name is a path
    assert find_task("sub/gemma4-tiny-cpu") == Path("sub/gemma4-tiny-cpu")
    with pytest.raises(TaskError, match="task file not found: gemma4-tiny-cpu.yaml"):
        load_task("gemma4-tiny-cpu.yaml")
    with pytest.raises(TaskError, match="no built-in task named 'nope' .*gemma4-tiny-cpu"):
        find_task("nope")
    (tmp_path / "mine").write_text((ROOT / "tasks" / "gemma4-tiny-cpu.yaml").read_text())
    assert find_task("mine") == Path("mine")  # no built-in task by that name, but a file here


def _run(argv, **kwargs):
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{argv}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_runs_the_builtin_task(tmp_path):
    """Build a wheel from a copy of the project's sources, install it with --no-deps into a fresh venv (the system's
    packages visible for the dependencies), and from a folder outside the project: `nightshift validate` finds the
    built-in default by name and resolves its model config inside the installed package, and `nightshift run`
    loads the default task (it stops after, at a setting the task refuses)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", str(src),
          "-w", str(wheels)])
    (wheel,) = wheels.glob("nightshift-*.whl")
    env_dir = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env_dir)])
    python, nightshift = env_dir / "bin" / "python", env_dir / "bin" / "nightshift"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(NIGHTSHIFT_CACHE=str(tmp_path / "cache"), COLUMNS="200", PYTHONDONTWRITEBYTECODE="1")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-cache-dir", str(wheel)],
         env=env)
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    where = _run([str(python), "-c", "import agent.world.task as t; print(t.__file__); print(t.builtin_tasks())"],
                 cwd=outside, env=env).stdout.split()
    assert all(Path(p).is_relative_to(env_dir) for p in where), where  # the installed copy, not this checkout

    shown = json.loads(_run([str(nightshift), "validate", DEFAULT_TASK], cwd=outside, env=env).stdout)
    assert shown["name"] == DEFAULT_TASK
    config = Path(shown["model"]["synthetic"]["config"])
    assert config.is_relative_to(env_dir) and config.is_file(), config
    assert json.loads(config.read_text()) == json.loads((ROOT / "tasks/models/gemma4-tiny/config.json").read_text())
    for name in ("gemma4-tiny-cpu-llm", "gemma4-e2b", "gemma4-e2b-llm"):
        assert json.loads(_run([str(nightshift), "validate", name], cwd=outside, env=env).stdout)["name"] == name

    refused = subprocess.run([str(nightshift), "run", "--set", "workload.num_prompts=0"], cwd=outside, env=env,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "workload.num_prompts: Input should be greater than 0" in refused.stderr, \
        refused.stderr
    missing = subprocess.run([str(nightshift), "validate", "nope"], cwd=outside, env=env, capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode == 2 and "no built-in task named 'nope'" in missing.stderr, missing.stderr


def test_a_resumed_run_finds_a_recorded_model_config_among_the_builtin_tasks(tmp_path):
    """A run recorded on a host whose project was elsewhere finds its model config in the built-in tasks (where an
    installed package keeps it) when this project holds no copy (agent/run/resume.py here)."""
    from agent.run.resume import here

    recorded = Path("/gone/elsewhere/tasks/models/gemma4-tiny/config.json")
    assert here(recorded, tmp_path / "no-project") == builtin_tasks() / "models" / "gemma4-tiny" / "config.json"
