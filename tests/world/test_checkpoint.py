"""Synthetic checkpoints: seeded, cached per knobs, knobs that do what they say (tiny Gemma 4, CPU)."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from agent.world.checkpoint import ensure_synthetic, weights_sha256

CONFIG = Path(__file__).resolve().parents[2] / "tasks" / "models" / "gemma4-tiny" / "config.json"


def embedding(folder: Path) -> torch.Tensor:
    tensors = {}
    for shard in folder.glob("*.safetensors"):
        tensors.update(load_file(shard))
    return next(v for k, v in tensors.items() if k.endswith("embed_tokens.weight")).float()


def test_knobs_are_seeded_cached_and_shape_the_embedding(tmp_path):
    plain = ensure_synthetic(CONFIG, seed=3, cache=tmp_path)
    again = ensure_synthetic(CONFIG, seed=3, cache=tmp_path)
    spread = ensure_synthetic(CONFIG, seed=3, cache=tmp_path, embedding_norm_sigma=0.5)
    assert again.path == plain.path and again.sha256 == plain.sha256 == weights_sha256(plain.path)
    assert spread.path != plain.path and spread.sha256 != plain.sha256
    assert json.loads((spread.path / "nightshift-checkpoint.json").read_text())["knobs"]["embedding_norm_sigma"] == 0.5
    base, shaped = embedding(plain.path), embedding(spread.path)
    rows = base.norm(dim=1) > 0  # the padding row is zero
    base, shaped = base[rows], shaped[rows]
    ratios = shaped.norm(dim=1) / base.norm(dim=1)
    assert 0.4 < float(ratios.log().std()) < 0.6
    assert torch.allclose(shaped / ratios[:, None], base, rtol=0.02, atol=1e-3)
    assert spread.margins is not None and spread.margins.median > plain.margins.median


def test_how_a_checkpoint_was_written_is_recorded_and_a_different_sha256_names_its_cause(tmp_path):
    """The manifest (and the run_started record) says on what device, in what dtype and with which libraries the
    seeded weights were written; a checkpoint whose sha256 differs from a run's is explained by the fields that
    differ. Manifests and traces from before it load (nothing recorded: said so)."""
    import numpy
    import safetensors

    from agent.world.checkpoint import CheckpointInfo, mismatch
    from traces.schema import CheckpointWritten, RunStarted

    info = ensure_synthetic(CONFIG, seed=5, cache=tmp_path)
    written = info.written
    assert not info.cached and written is not None
    assert (written.sha256, written.seed, written.device, written.dtype) == (info.sha256, 5, "cpu", "bfloat16")
    assert (written.torch, written.safetensors, written.numpy) == \
        (torch.__version__, safetensors.__version__, numpy.__version__)
    assert written.transformers and written.device_name
    assert f"sha256 {info.sha256[:16]}" in info.describe() and "cpu" in info.describe()
    again = ensure_synthetic(CONFIG, seed=5, cache=tmp_path)
    assert again.cached and again.written == written and "(cached)" in again.describe()
    assert "cached" not in json.loads((info.path / "nightshift-checkpoint.json").read_text())

    elsewhere = written.model_copy(update={"sha256": "0" * 64, "device": "cuda", "device_name": "NVIDIA H200",
                                           "torch": "2.11.0+cu130", "cuda": "13.0"})
    why = mismatch(elsewhere, info)
    assert why.startswith("written differently") and "device cuda -> cpu" in why and "torch 2.11.0+cu130" in why
    assert "numpy" not in why  # the same on both
    assert "the cause is not among" in mismatch(written.model_copy(update={"sha256": "0" * 64}), info)

    # before it was recorded: an old manifest, an old trace
    old = CheckpointInfo.model_validate({k: v for k, v in json.loads(info.model_dump_json()).items()
                                         if k != "written"})
    assert old.written is None and "not recorded" in mismatch(written, old)
    assert "not recorded; here: sha256" in mismatch(None, info)
    started = {"kind": "run_started", "run_id": "r", "nightshift_version": "0", "vllm_version": "0",
               "torch_version": "0", "python_version": "3", "platform": "p", "checkout": "c", "base_commit": "b",
               "branch": "x", "model_sha256": "s", "task": {}}
    assert RunStarted.model_validate(started).model_written is None
    assert RunStarted.model_validate({**started, "model_written": written.model_dump()}).model_written == written
    assert CheckpointWritten().differences(written) == []
