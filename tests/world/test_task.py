from pathlib import Path

import pytest
import yaml

from agent.world.task import TaskError, load_task, parse_task, with_overrides

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "tasks" / "gemma4-tiny-cpu.yaml"


def default_data() -> dict:
    return yaml.safe_load(DEFAULT.read_text())


def test_default_task_loads_and_resolves_paths():
    task = load_task(DEFAULT)
    assert task.name == "gemma4-tiny-cpu"
    assert task.model.synthetic.config == ROOT / "tasks" / "models" / "gemma4-tiny" / "config.json"
    assert task.model.synthetic.config.is_file()
    assert task.proposer.kind == "flags"
    assert set(task.proposer.space) <= set(task.edit_surface.engine_args)


def test_unknown_key_is_rejected_with_its_path():
    data = default_data()
    data["workload"]["num_promts"] = 3
    with pytest.raises(TaskError) as err:
        parse_task(data, "t.yaml")
    assert "workload.num_promts: Extra inputs are not permitted" in str(err.value)


def test_bad_values_name_every_field():
    data = default_data()
    data["workload"]["num_prompts"] = 0
    data["acceptance"]["confidence"] = 1.5
    with pytest.raises(TaskError) as err:
        parse_task(data, "t.yaml")
    message = str(err.value)
    assert "2 problem(s)" in message
    assert "workload.num_prompts" in message and "acceptance.confidence" in message


def test_model_needs_exactly_one_source():
    data = default_data()
    data["model"]["path"] = "/somewhere"
    with pytest.raises(TaskError, match="exactly one of model.path"):
        parse_task(data)


def test_flag_space_must_be_inside_the_surface():
    data = default_data()
    data["proposer"]["space"]["enforce_eager"] = [True, False]
    with pytest.raises(TaskError, match="enforce_eager"):
        parse_task(data)


def test_proposer_kind_is_discriminated():
    data = default_data()
    data["proposer"] = {"kind": "queue", "patches": "patches", "space": {}}
    with pytest.raises(TaskError, match="proposer.space"):
        parse_task(data)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(TaskError, match="not found"):
        load_task(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(TaskError, match="not valid YAML"):
        load_task(bad)


def test_overrides_replace_the_proposer_and_merge_sections():
    task = with_overrides(load_task(DEFAULT), proposer={"kind": "queue", "patches": "/p"},
                          budget={"max_candidates": 1})
    assert task.proposer.kind == "queue" and str(task.proposer.patches) == "/p"
    assert task.budget.max_candidates == 1 and task.budget.wall_clock_s == 2400


def test_settings_override_nested_fields_and_name_bad_ones():
    from agent.world.task import with_settings

    task = load_task(ROOT / "tasks" / "gemma4-e2b.yaml")
    changed = with_settings(task, ["workload.input_len=8192", "benchmark.repetitions=3",
                                   "proposer.space={max_num_seqs: [256, 512]}", "model.synthetic.seed=7"])
    assert (changed.workload.input_len, changed.benchmark.repetitions, changed.model.synthetic.seed) == (8192, 3, 7)
    assert changed.proposer.space == {"max_num_seqs": [256, 512]} and task.workload.input_len == 1024
    with pytest.raises(TaskError, match="workload.inputlen"):
        with_settings(task, ["workload.inputlen=5"])
    with pytest.raises(TaskError, match="expected section.key=value"):
        with_settings(task, ["workload.input_len"])
    with pytest.raises(TaskError, match="not a section"):
        with_settings(task, ["nope.key=1"])


def test_loosened_checks_are_named_against_the_defaults_and_the_task_file():
    from agent.run.relaxed import describe, relaxed
    from agent.world.task import with_settings

    task = load_task(DEFAULT)
    assert relaxed(task, task) == []  # the built-in task is as strict as the defaults or stricter
    run = with_settings(task, ["audit.hard_bound_nats=8", "acceptance.min_speedup=1.01", "acceptance.confidence=0.99",
                               "benchmark.max_idle_cpu=null", "audit.sample=4", "acceptance.confirmations=0",
                               "benchmark.max_client_busy=0.5", "audit.enabled=false"])
    assert [describe(e) for e in relaxed(run, task)] == [
        "acceptance.min_speedup=1.01 (default 1.02)",  # the file's own is the default
        "acceptance.confirmations=0 (task file 1)",
        "benchmark.max_idle_cpu=null (default 0.25)",
        "audit.enabled=false (default true)",
        "audit.sample=4 (default null)",
        "audit.hard_bound_nats=8 (default 6)"]
    # a trace of before the record held them: against the defaults only
    assert [e["setting"] for e in relaxed(run.model_dump(mode="json"))] == [
        "acceptance.min_speedup", "benchmark.max_idle_cpu", "audit.enabled", "audit.sample", "audit.hard_bound_nats"]
    # isolation: `local` reaches every process and file of the run, so it is looser than the default namespace;
    # docker is as strict or stricter; a backend a file registers is not ranked
    assert [describe(e) for e in relaxed(with_settings(task, ["sandbox.backend=local"]), task)] == [
        "sandbox.backend=local (default namespace)"]
    assert relaxed(with_settings(task, ["sandbox.backend=docker"]), task) == []
    # fewer long parity requests than the task's: less of the served lengths checked
    assert [describe(e) for e in relaxed(with_settings(task, ["parity.long_prompts=1"]), task)] == [
        "parity.long_prompts=1 (default 4)"]
