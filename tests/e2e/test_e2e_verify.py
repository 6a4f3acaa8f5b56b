"""`nightshift verify` end to end on the real vLLM CPU build: a head commit with its own serving flags (a
`nightshift.serve.yaml`, as a kept candidate's commit has) against the unmodified tree, over a small grid."""
import json
import os
import subprocess
import sys
from pathlib import Path

import git
import pytest
import yaml

from agent.world.serve_args import SERVE_FILE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def serve_commit(checkout: Path, tmp_path: Path, engine_args: dict) -> str:
    """A commit on the version tag that changes only the serving flags; the checkout's own tree stays as it was."""
    repo = git.Repo(checkout)
    tree = tmp_path / "head"
    repo.git.worktree("add", "--detach", str(tree), "v0.32.0")
    try:
        (tree / SERVE_FILE).write_text(yaml.safe_dump({"engine_args": engine_args}, sort_keys=True))
        head = git.Repo(tree)
        head.git.add(SERVE_FILE)
        head.git.commit("-qm", "serving flags", env=GIT_ENV)
        return head.head.commit.hexsha
    finally:
        repo.git.worktree("remove", "--force", str(tree))


def test_verify_a_serving_flags_commit_on_a_small_grid(vllm_checkout, tmp_path):
    head = serve_commit(vllm_checkout, tmp_path, {"enforce_eager": True, "max_num_seqs": 32})
    runs = tmp_path / "runs"
    out = subprocess.run(
        [sys.executable, "-m", "agent.face.cli", "verify", "--checkout", str(vllm_checkout), "--head", head,
         "--base", "v0.32.0", "--task", str(ROOT / "tasks" / "gemma4-tiny-cpu.yaml"), "--runs-dir", str(runs),
         "--input-lens", "32,64,4096", "--output-lens", "16", "--concurrency", "1,4", "--repetitions", "3",
         "--set", "parity.num_prompts=3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=840, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160"})
    print(out.stdout[-6000:], out.stderr[-3000:])
    assert out.returncode in (0, 1), out.stderr
    (folder,) = runs.iterdir()
    data = json.loads((folder / "verify" / "verify.json").read_text())
    assert out.returncode == (1 if data["regressions"] or data["failed"] else 0)
    cells = {c["key"]: c for c in data["cells"]}
    assert sorted(cells) == sorted(f"in{i}-out16-c{c}" for i in (32, 64, 4096) for c in (1, 4))
    for c in (1, 4):
        assert cells[f"in4096-out16-c{c}"]["status"] == "skipped"
        assert "max_position_embeddings 4096" in cells[f"in4096-out16-c{c}"]["reason"]
    assert data["grid"]["max_model_len"] == 64 + 16 + 1
    assert data["settings"] == ["parity.num_prompts=3"]
    assert data["head"]["engine_args"]["max_num_seqs"] == 32 and data["base"]["engine_args"]["max_num_seqs"] == 4
    for key in ("in32-out16-c1", "in32-out16-c4", "in64-out16-c1", "in64-out16-c4"):
        cell = cells[key]
        assert cell["status"] == "ok", cell["reason"]
        assert cell["parity"]["ok"] and cell["parity"]["regime"] == "sequential" and cell["parity"]["prompts"] == 3
        assert cell["audit"]["passed"] and cell["audit"]["tokens"] == 3 * cell["num_prompts"] * 16
        assert cell["baseline"]["total_token_throughput"] > 0 and cell["head"]["median_tpot_ms"] > 0
        gain = cell["speedup"]["total_token_throughput"]
        assert gain["ci_low"] <= gain["speedup"] <= gain["ci_high"]
        assert cell["regression"] == (gain["ci_high"] < 1.0)
    env = data["environment"]
    assert env["gpu"] == "cpu" and env["vllm"].startswith("0.32.0") and env["max_model_len"] == 81
    assert "| 32 | 16 |" in (folder / "verify" / "verify.md").read_text()
    assert "task overrides: parity.num_prompts=3" in (folder / "verify" / "verify.md").read_text()
    assert "Verify grid" in (folder / "report.html").read_text()
    assert "grid cells" in out.stdout or "cells:" in out.stdout
    assert not any(p.name in ("baseline", "head") for p in (folder / "verify" / "worktrees").glob("*"))
