"""A harness process for the crash tests: `nightshift run` (or `run --resume`) on fake servers.

    python3 -m tests.resume_driver start TASK_JSON RUNS_DIR RUN_ID
    python3 -m tests.resume_driver resume RUN_DIR
    python3 -m tests.resume_driver resume PACK_OR_FOLDER RUNS_DIR [CHECKOUT]   # a run moved to another folder
    python3 -m tests.resume_driver noise TASK_JSON RUNS_DIR RUN_ID AA          # `nightshift noise`, AA A/As

The same code path as the CLI (agent/face/cli.py run_loop), with tests/fake_sandbox.py servers (a parallel run's
workers too, on the Ray cluster at RAY_ADDRESS) and a pure-Python stand-in for vLLM; NIGHTSHIFT_TEST_CRASH
(traces/log.py) makes it SIGKILL itself at a chosen record."""
import sys
from pathlib import Path

from agent.face.cli import noise_study, resume_loop, run_loop
from agent.proposers import make_proposer
from agent.run.setup import prepare_run
from agent.world.task import Task
from tests.fake_sandbox import FakeSandbox, worker_sandbox

VERSION = "0.32.0"

if __name__ == "__main__":
    if sys.argv[1] == "noise":
        task = Task.model_validate_json(Path(sys.argv[2]).read_text())
        setup = prepare_run(task, Path(sys.argv[3]), run_id=sys.argv[4], vllm_version=VERSION)
        noise_study(setup, int(sys.argv[5]), [], 1, False, sandbox=FakeSandbox(setup.run_dir / "servers"))
    elif sys.argv[1] == "start":
        task = Task.model_validate_json(Path(sys.argv[2]).read_text())
        setup = prepare_run(task, Path(sys.argv[3]), run_id=sys.argv[4], vllm_version=VERSION)
        run_loop(setup, make_proposer(task), quiet=True, sandbox=FakeSandbox(setup.run_dir / "servers"),
                 worker_sandbox=worker_sandbox)
    else:
        run = Path(sys.argv[2]).resolve()
        runs_dir = Path(sys.argv[3]) if len(sys.argv) > 3 else run.parent
        checkout = Path(sys.argv[4]) if len(sys.argv) > 4 else None
        resume_loop(str(run), runs_dir, quiet=True, vllm_version=VERSION,
                    sandbox=lambda run_dir: FakeSandbox(run_dir / "servers"), worker_sandbox=worker_sandbox,
                    checkout=checkout)
