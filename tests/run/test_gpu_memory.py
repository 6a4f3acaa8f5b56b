"""The preflight that the servers of one step fit on the GPU together (agent/run/preflight.py check_gpu_memory).

Seen on an H100 80GB with the E2B task (benchmarks/results/h200-window-5.md): a candidate's production server found
21 GiB free beside the reference, the incumbent and its own parity server, could not allocate its 16 GiB KV cache,
and was recorded as the candidate's crash; the next candidate died the same way. The same task ran its candidates on
the H200 (139 GiB). Numbers from those hosts: E2B's synthetic checkpoint holds 8.86 GiB of weights."""
from pathlib import Path

import pytest

from agent.run.preflight import (GIB, PreflightError, check_gpu_memory, check_model_fits, step_servers, study_servers,
                                 weights_bytes)
from agent.world.task import load_task, with_overrides

ROOT = Path(__file__).resolve().parents[2]
E2B = load_task(ROOT / "tasks" / "gemma4-e2b.yaml")
E2B_WEIGHTS = int(8.86 * GIB)
H100 = int(79.18 * GIB)
H200 = int(139.8 * GIB)


def test_the_e2b_task_is_refused_on_an_80_gb_card_before_any_server_starts():
    with pytest.raises(PreflightError) as refused:
        check_gpu_memory(E2B, E2B_WEIGHTS, H100, "NVIDIA H100 80GB HBM3")
    message = str(refused.value)
    assert "NVIDIA H100 80GB HBM3 has 79.2 GiB" in message and "about 83.4 GiB" in message, message
    assert "candidate 26.9" in message and "candidate's parity server 14.9" in message and "kv_cache_memory_bytes" in message


def test_the_e2b_task_fits_the_h200_it_ran_its_candidates_on():
    check_gpu_memory(E2B, E2B_WEIGHTS, H200, "NVIDIA H200")


def test_a_noise_study_is_counted_as_it_holds_its_servers():
    """`nightshift noise` on an H100 was refused with the run's four servers (83 GiB), though its A/As start three:
    the audit's reference and two production copies (68.6 GiB). With a patch it holds a fourth production server."""
    aa = study_servers(E2B, 2)
    assert [name for name, _ in aa] == ["reference", "production server 1", "production server 2"]
    assert aa[0][1]["kv_cache_memory_bytes"] == 4 * GIB  # the reference is a parity server, as in a run
    check_gpu_memory(E2B, E2B_WEIGHTS, H100, "NVIDIA H100 80GB HBM3", aa)
    with pytest.raises(PreflightError, match="about 95.4 GiB.*some would fail to start"):
        check_gpu_memory(E2B, E2B_WEIGHTS, H100, "NVIDIA H100 80GB HBM3", study_servers(E2B, 3))
    unaudited = with_overrides(E2B, audit={**E2B.audit.model_dump(), "enabled": False})
    assert [name for name, _ in study_servers(unaudited, 2)] == ["production server 1", "production server 2"]


def test_the_step_is_counted_as_the_run_holds_it():
    """Parity servers of their own: two of each configuration; without, three production servers."""
    assert [name for name, _ in step_servers(E2B)] == ["reference", "incumbent", "candidate's parity server",
                                                        "candidate"]
    assert step_servers(E2B)[0][1]["kv_cache_memory_bytes"] == 4 * GIB  # the parity servers' own KV cache
    plain = with_overrides(E2B, parity={"env": {}, "args": {}, "regime": "sequential"})
    assert [name for name, _ in step_servers(plain)] == ["reference", "incumbent", "candidate"]


def test_shares_of_the_gpu_that_add_up_past_it_are_refused_and_shares_that_fit_pass():
    """Without a fixed KV cache each server takes gpu_memory_utilization of the card, whatever its weights."""
    def shares(fraction):
        args = {k: v for k, v in E2B.engine.args.items() if k != "kv_cache_memory_bytes"}
        return with_overrides(E2B, engine={**E2B.engine.model_dump(), "args": {**args, "gpu_memory_utilization": fraction}},
                              parity={"env": {}, "args": {}, "regime": "sequential"})
    with pytest.raises(PreflightError, match="about 85.5 GiB"):
        check_gpu_memory(shares(0.36), E2B_WEIGHTS, H100, "GPU")  # three servers at 0.36 of 79.18 GiB
    check_gpu_memory(shares(0.3), E2B_WEIGHTS, H100, "GPU")


def test_a_cpu_task_is_not_asked(tmp_path):
    check_model_fits(load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml"), tmp_path)  # no GPU named: nothing to read


def test_the_weights_are_the_model_folders_weight_files(tmp_path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"\0" * 24)
    (tmp_path / "config.json").write_text("{}")
    assert weights_bytes(tmp_path) == 1024


def test_a_run_on_a_card_too_small_is_refused_from_what_nvml_says_and_the_model_folder_holds(tmp_path, monkeypatch):
    """check_model_fits, as prepare_run calls it: the card's size as NVML reports it (here the H100's, since no GPU
    is at hand) and the weights as the model folder holds them (a sparse file of E2B's size)."""
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(E2B_WEIGHTS)
    monkeypatch.setattr("agent.world.environment.gpu_memory", lambda index: ("NVIDIA H100 80GB HBM3", H100))
    with pytest.raises(PreflightError, match="NVIDIA H100 80GB HBM3 has 79.2 GiB"):
        check_model_fits(E2B, tmp_path)
    monkeypatch.setattr("agent.world.environment.gpu_memory", lambda index: ("NVIDIA H200", H200))
    check_model_fits(E2B, tmp_path)
    monkeypatch.setattr("agent.world.environment.gpu_memory", lambda index: None)  # no NVML: nothing to compare
    check_model_fits(E2B, tmp_path)
