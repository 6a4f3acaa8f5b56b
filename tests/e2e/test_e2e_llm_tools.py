"""The tool-using LLM proposer end to end on the real vLLM CPU build: two scripted models on the loopback
OpenAI-compatible server drive the real loop on the CPU task (real servers, parity, benchmark, audit, git).

The expert explores the real tree (list, grep, read), proposes an identity edit, reads the harness's answer and
proposes a change worth keeping: exact overhead cuts of eager CPU decode in eight files
(benchmarks/cpu-code-patches/07: about 1.15-1.20x at the task's judge), exact for any weights. It builds, is
imported by the server, passes parity and the audit, and is kept by the task's own judge (its sequential plan and
a confirmation on fresh prompts), a commit of code and no flag; `replay` re-derives the run. The adversary's
change is right alone and wrong in batches: it passes parity (one request at a time) and is rejected at the audit.

The run is also the CPU task end to end in containers (`sandbox.backend: docker`): every server of it is a container
of the sandbox image, so this one run carries what two runs did. Needs a Docker engine and the image
(scripts/docker-engine.sh, scripts/docker-image.sh), as tests/sandbox/test_docker_sandbox.py does."""
import json

import pytest

from agent.replay.chain import audit
from agent.run.loop import Loop
from agent.proposers.llm import LlmProposer
from agent.face.report import review_tables
from fake_openai_server import FakeOpenAI
from scripted_models import GEMMA4, gemma4_adversary, gemma4_exact_expert, numbered
from tests.e2e.test_e2e_vllm import ROOT, cli, events
from agent.run.setup import prepare_run
from agent.run.workspace import serve_args_at
from agent.world.serve_args import SERVE_FILE
from agent.world.task import load_task, with_overrides
from tests.conftest import SANDBOX_IMAGE
from traces import read_trace

EDITED = ["vllm/model_executor/layers/activation.py", "vllm/model_executor/layers/attention/attention.py",
          "vllm/model_executor/layers/layernorm.py", "vllm/model_executor/layers/linear.py",
          "vllm/model_executor/layers/utils.py", GEMMA4, "vllm/v1/attention/backends/cpu_attn.py",
          "vllm/v1/worker/cpu_worker.py"]

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.timeout(3000)]


@pytest.fixture(scope="module")
def scripted_run(tmp_path_factory, vllm_checkout, engine):
    script = numbered(gemma4_exact_expert((vllm_checkout / GEMMA4).read_text()) + gemma4_adversary())
    with FakeOpenAI(script=script) as server:
        task = load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml")
        # No A/A before the first candidate here: tests/run/test_noise_floor.py runs it on this task. The audit runs
        # with the task's own rule (its honest noise on an AMX CPU is the control's too)
        task = with_overrides(task, target={"checkout": str(vllm_checkout)}, budget={"max_candidates": 2},
                              # The task's rule (pairs until the group-sequential test decides, then a
                              # confirmation on fresh prompts) decides the expert's change, its plan cut to the suite's
                              # time: looks at 8, 16 and 24 pairs of 16 prompts, not 8-40 of 32. Alone on a quiet
                              # machine the task's full plan kept it at 1.174x, confirmed at 1.192x [1.059, 1.343], 16
                              # pairs each, in 14 minutes with the adversary below (benchmarks/cpu-code-patches/README.md).
                              # Beside the suite a plan that ended at 16 pairs discarded it once in seven clean-clone
                              # CIs: 1.115x [1.001, 1.243] (docs/tests.md); a third look goes on where 16 do not decide
                              benchmark={"noise_floor": False, "max_repetitions": 24},
                              workload={"num_prompts": 16},
                              parity={"num_prompts": 8},  # the task's 64 are tested in tests/run/test_loop_judgement.py
                              proposer={"kind": "llm", "base_url": server.base_url, "model": "scripted-expert",
                                        "api_key_env": None, "profile": False, "tools": "native",
                                        "request_timeout_s": 30, "max_retries": 0, "repair_turns": 0},
                              sandbox={"backend": "docker", "image": SANDBOX_IMAGE, "memory_gb": 8, "tmpfs_mb": 2048})
        setup = prepare_run(task, tmp_path_factory.mktemp("llm-tools") / "runs")
        loop = Loop(setup, LlmProposer.from_task(task))
        backend = type(loop.pool.sandbox).__name__
        finished = loop.run()
    return setup, finished, read_trace(setup.run_dir / "trace.jsonl"), backend


def test_the_scripted_expert_fixes_its_mistake_and_its_exact_code_change_is_kept(scripted_run):
    setup, finished, records, _ = scripted_run
    calls = [e for e in events(records, "tool_call") if e.candidate == 1]
    assert [c.name for c in calls] == ["list_dir", "grep", "read_file", "propose", "propose"]
    assert "gemma4.py (" in calls[0].result and "layer_scalar" in calls[1].result
    assert "identity: FAILED" in calls[3].result and "ACCEPTED" in calls[4].result
    decision = next(d for d in events(records, "decision") if d.candidate == 1)
    assert decision.stage == "decision" and decision.speedup is not None, decision.reason
    bench = next(b for b in events(records, "benchmark") if b.candidate == 1)
    assert set(bench.liveness.imported_patched) == set(EDITED)  # the server ran the eight edited modules
    parity = next(p for p in events(records, "parity") if p.candidate == 1)
    audits = [a for a in events(records, "audit") if a.candidate == 1]
    assert parity.ok and audits and all(a.violation_count == 0 for a in audits)
    assert decision.verdict == "keep", decision.reason  # the mission: an exact code change kept
    commit = next(c for c in events(records, "commit") if c.candidate == 1)
    assert set(setup.repo.commit(commit.commit).stats.files) == {*EDITED, SERVE_FILE}
    assert serve_args_at(setup.repo, commit.commit) == dict(setup.task.engine.args)  # code, and no flag
    applied = next(p for p in events(records, "patch_applied") if p.candidate == 1)
    assert applied.engine_args == dict(setup.task.engine.args) and set(applied.files) == set(EDITED)
    replay = cli("replay", setup.run_dir.name, "--runs-dir", str(setup.run_dir.parent))
    assert replay.returncode == 0 and "audit ok" in replay.stdout, replay.stdout + replay.stderr
    entry = next(e for e in events(records, "notebook") if e.candidate == 1)
    assert f"speedup {decision.speedup:.3f}x [{decision.ci_low:.3f}, {decision.ci_high:.3f}]" in entry.summary
    assert review_tables(setup.run_dir)[-1].title.startswith("lab notebook")
    print(f"\nexpert: {decision.verdict} {decision.speedup:.3f}x [{decision.ci_low:.3f}, {decision.ci_high:.3f}]: "
          f"{decision.reason}")


def test_the_scripted_adversary_right_alone_wrong_in_batches_is_rejected_at_the_audit(scripted_run):
    """tests/fixtures/adversarial/01-batch-crosstalk.patch as the model's edit: in a step that samples several
    sequences each gets its neighbour's logits. Parity passes; the audit of the benchmark's outputs rejects it at the
    hard bound (another sequence's token is several nats off), naming the request and position."""
    setup, finished, records, _ = scripted_run
    decision = next(d for d in events(records, "decision") if d.candidate == 2)
    parity = next(p for p in events(records, "parity") if p.candidate == 2)
    assert parity.ok, "the adversary must pass parity for this test to mean anything"
    assert (decision.verdict, decision.stage) == ("discard", "audit"), decision.reason
    bench = next(b for b in events(records, "benchmark") if b.candidate == 2)
    assert bench.liveness.imported_patched == [GEMMA4]
    token_audit = next(a for a in events(records, "audit") if a.candidate == 2)
    assert not token_audit.verdict.passed and token_audit.control.tokens == token_audit.tokens
    assert token_audit.verdict.test == "hard_bound" and token_audit.deficits.max > 6  # another sequence's token
    v = token_audit.violations[0]
    assert f"request {v.request}, position {v.position}: returned {v.returned}" in decision.reason
    assert not [b for b in events(records, "benchmark") if b.candidate == 2 and b.confirmation]
    entry = next(e for e in events(records, "notebook") if e.candidate == 2)
    assert entry.divergence and "right alone, wrong in a batch" in entry.learned
    taken_back = [e.reason for e in events(records, "incumbent_reverted")]  # an exact keep is never taken back
    assert audit(setup.run_dir).commits == finished.kept and not taken_back, taken_back


def test_every_server_of_the_run_was_a_container_and_none_is_left(scripted_run, engine):
    """The CPU task end to end in containers: the baseline phase and both candidates served by the sandbox image,
    the import log read across the socket folder, and no container of the run left behind."""
    setup, finished, records, backend = scripted_run
    assert backend == "DockerSandbox"
    assert [e.ok for e in events(records, "self_parity")] == [True]
    assert finished.candidates == 2
    for bench in events(records, "benchmark"):
        assert bench.liveness.imported_vllm_modules > 100  # the import log crossed the socket folder
    starts = [json.loads(line) for line in (setup.run_dir / "server_starts.jsonl").read_text().splitlines()]
    assert starts and {s["backend"] for s in starts} == {"docker"}, starts
    assert not engine.containers.list(all=True, filters={"label": f"nightshift.run={setup.run_dir.name}"})
