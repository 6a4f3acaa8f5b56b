"""One registry per extension point (agent/extensions.py): a new proposer or sandbox backend is one file, here this
one, and the task schema, the CLI, make_proposer, make_sandbox and the run's checks take it."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from typer.testing import CliRunner

from agent.extensions import PROPOSERS, ProposerKind, register_backend, register_proposer
from agent.proposers import make_proposer
from agent.run.preflight import check_sandbox
from agent.world.task import Strict, TaskError, load_task, with_overrides
from sandbox import make_sandbox
from sandbox.config import SandboxConfig
from sandbox.local import LocalSandbox
from traces.errors import NightshiftError

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "tasks" / "gemma4-tiny-cpu.yaml"


class EchoSection(Strict):
    kind: Literal["echo"] = "echo"
    times: int = 1


class Echo:
    name, spend_usd = "echo", 0.0

    def __init__(self, times: int):
        self.times = times


made: list[Echo] = []
register_proposer(ProposerKind("echo", EchoSection, lambda task: made.append(Echo(task.proposer.times)) or made[-1],
                               from_cli=lambda patches: {"kind": "echo", "times": 2}))


class Unavailable(NightshiftError):
    stage = "sandbox"


class BoxSandbox(LocalSandbox):
    probed: list = []

    @classmethod
    def probe(cls, config) -> None:
        cls.probed.append(config.backend)
        if config.image == "missing":
            raise Unavailable("no box here")


register_backend("box", BoxSandbox)


def test_a_registered_proposer_is_a_valid_task_section_and_makes_its_proposer():
    task = with_overrides(load_task(TASK), proposer={"kind": "echo", "times": 3})
    assert isinstance(task.proposer, EchoSection) and task.model_dump()["proposer"] == {"kind": "echo", "times": 3}
    proposer = make_proposer(task)
    assert isinstance(proposer, Echo) and proposer.times == 3
    with pytest.raises(TaskError, match="unknown proposer kind 'nope'.*echo.*flags.*llm.*queue"):
        with_overrides(load_task(TASK), proposer={"kind": "nope"})
    with pytest.raises(TaskError, match="proposer.times"):
        with_overrides(load_task(TASK), proposer={"kind": "echo", "times": "many"})


def test_the_cli_takes_a_registered_proposer(monkeypatch, tmp_path):
    import agent.face.cli as cli

    started = []
    monkeypatch.setattr(cli, "start_detached", lambda argv, log, run_id, append=False: started.append(argv))
    made.clear()
    result = CliRunner().invoke(cli.app, ["run", str(TASK), "--proposer", "echo", "--detach",
                                          "--runs-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert made and made[-1].times == 2 and "echo" in started[0]
    assert PROPOSERS.get("echo").name == "echo"


def test_a_registered_backend_is_a_valid_setting_made_and_probed(tmp_path):
    config = SandboxConfig(backend="box")
    assert isinstance(make_sandbox(config, tmp_path), BoxSandbox)
    check_sandbox(config)
    assert BoxSandbox.probed == ["box"]
    with pytest.raises(Unavailable, match="no box here"):
        check_sandbox(SandboxConfig(backend="box", image="missing"))
    with pytest.raises(ValueError, match="unknown sandbox backend 'nobox'.*box.*docker.*local.*namespace"):
        SandboxConfig(backend="nobox")
