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
