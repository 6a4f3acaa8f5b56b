"""`nightshift propose`: the dry start of a task on this machine, with no server and no GPU. The built-in E2B LLM
task (its proposer set by the environment only, as a user leaving a frontier model on an H200 would set it) reaches
its first proposal through each provider contract's loopback server (tests/fake_providers.py); and a dry start that
gets no proposal, or has no sources to read, says so."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fake_openai_server import FakeOpenAI
from fake_providers import Anthropic, Gemini, OpenAIReasoning, Vllm
from scripted_models import GEMMA4, gemma4_expert, numbered

ROOT = Path(__file__).resolve().parents[2]


def installed_gemma4() -> str:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        pytest.skip("vLLM is not installed")
    return (Path(spec.origin).parent / "model_executor" / "models" / "gemma4.py").read_text()


@pytest.fixture
def sources(tmp_path) -> Path:
    """A git checkout of the sources the E2B task edits, written as vLLM 0.26.0's (the GPU host's version; the
    model file is the installed vLLM's)."""
    root = tmp_path / "vllm-0.26.0"
    files = {"vllm/__init__.py": "", "vllm/_version.py": '__version__ = "0.26.0"\n',
             "vllm/model_executor/__init__.py": "", "vllm/model_executor/models/__init__.py": "",
             GEMMA4: installed_gemma4(), "vllm/entrypoints/api.py": "CHECK_PARITY = True\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for argv in (["init", "-q", "-b", "main"], ["add", "-A"],
                 ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "vllm 0.26.0"]):
        subprocess.run(["git", *argv], cwd=root, check=True, capture_output=True)
    return root


def propose(*args: str, url: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160", "NIGHTSHIFT_LLM_URL": url,
           "NIGHTSHIFT_LLM_KEY": "sk-dry-start", "NIGHTSHIFT_LLM_MODEL": "frontier"}
    return subprocess.run([sys.executable, "-m", "agent.face.cli", "propose", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("contract", [OpenAIReasoning(), Gemini(), Anthropic(), Vllm()], ids=lambda c: c.name)
def test_the_e2b_llm_task_reaches_its_first_proposal_through_each_providers_contract(contract, sources, tmp_path):
    script = gemma4_expert((sources / GEMMA4).read_text())
    if not isinstance(contract, (OpenAIReasoning, Vllm)):
        script = [{**s, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in s["tool_calls"]]}
                  for s in script]  # the provider names its calls
    else:
        script = numbered(script)
    patch = tmp_path / "first.patch"
    with FakeOpenAI(script=script, contract=contract) as server:
        proc = propose(str(ROOT / "tasks" / "gemma4-e2b-llm.yaml"), "--checkout", str(sources), "--patch", str(patch),
                       url=server.base_url, cwd=tmp_path)
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert server.refused == [], server.refused  # every request met the provider's rules
    assert all(r["body"]["model"] == "frontier" for r in server.requests)
    assert "proposal 1 by llm: the layer scalar's product in place in every Gemma 4 decoder layer" in out
    assert f"{len(server.requests)} LLM calls (0 failed)" in out
    assert "tools: list_dir, grep, read_file, propose, propose" in out
    assert "no profile of the model: a dry start runs no model" in out
    assert "the task targets vLLM 0.26.0; the proposer read the sources of vLLM 0.26.0" not in out  # same version
    assert f"+++ b/{GEMMA4}" in proc.stdout and patch.read_text() in proc.stdout and "layer_scalar" in patch.read_text()
    subprocess.run(["git", "apply", "--check", str(patch)], cwd=sources, check=True)  # it applies to the sources read
    assert subprocess.run(["git", "worktree", "list"], cwd=sources, capture_output=True,
                          text=True).stdout.count("\n") == 1  # the dry start's worktree is gone
    assert not subprocess.run(["git", "status", "--porcelain"], cwd=sources, capture_output=True,
                              text=True).stdout  # nothing written in the checkout


def test_another_version_is_named_and_an_endpoint_that_never_proposes_is_exit_1(sources, tmp_path):
    (sources / "vllm" / "_version.py").write_text('__version__ = "0.32.0"\n')
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "0.32"], cwd=sources,
                   check=True)
    with FakeOpenAI(default={"text": "I would rather not change anything."}) as server:
        proc = propose(str(ROOT / "tasks" / "gemma4-e2b-llm.yaml"), "--checkout", str(sources),
                       "--set", "proposer.attempts_per_proposal=1", url=server.base_url, cwd=tmp_path)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1, out
    assert "the task targets vLLM 0.26.0; the proposer read the sources of vLLM 0.32.0" in out
    assert "no proposal: 1 LLM conversations in a row ended without a proposal" in out, out


def test_a_folder_that_is_not_a_vllm_checkout_is_refused_before_any_request(tmp_path):
    with FakeOpenAI(default={"text": "unused"}) as server:
        proc = propose(str(ROOT / "tasks" / "gemma4-e2b-llm.yaml"), "--checkout", str(tmp_path), url=server.base_url,
                       cwd=tmp_path)
        assert server.requests == []
    assert proc.returncode == 2 and "is not a git checkout" in " ".join(proc.stderr.split()), proc.stderr
