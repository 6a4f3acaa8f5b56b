"""Roofline: hand-checked FLOPs/bytes for a tiny config and for Gemma 4 E2B."""
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "gpu"))

import roofline as rl  # noqa: E402

E2B_PATHS = [
    os.path.join(ROOT, "tasks", "models", "gemma-4-e2b",
                 "config.json"),
]

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 100}


def e2b_config():
    for p in E2B_PATHS:
        if os.path.isfile(p):
            return json.load(open(p))
    pytest.skip("no Gemma 4 E2B config here")


def test_module_has_no_torch_import():
    src = open(rl.__file__).read()
    assert "import torch" not in src


def test_tiny_params_by_hand():
    # per layer: q+o 2*64*(2*16)=4096, k+v 2*64*(1*16)=2048, mlp 3*64*128=24576 -> 30720
    p = rl.linear_params(rl.ModelShape.from_config(TINY))
    assert p["per_layer"] == [30720, 30720]
    assert p["body"] == 61440
    assert p["lm_head"] == 6400


def test_tiny_flops_by_hand():
    # 3 in / 2 out, 5 positions: body 2*61440*5, head 2*6400*2, attention 4*2*16*(1+..+5)*2 layers
    f = rl.flops_per_request(rl.ModelShape.from_config(TINY), 3, 2)
    assert f["body"] == 614400
    assert f["lm_head"] == 25600
    assert f["attention"] == 3840
    assert f["total"] == 643840


def test_tiny_bytes_by_hand():
    # kv per token per layer 2*1*16*2 B = 64 B; writes 64*2*5 = 640
    # reads per layer: decode step from position 4 sees 4 keys (256 B) + prefill read 3 keys (192 B)
    # embeddings 64*2 B * 5 = 640; logits 2*100*2 B * 2 = 800; weights 0 (infinite batch)
    b = rl.bytes_per_request(rl.ModelShape.from_config(TINY), 3, 2)
    assert b["kv_write"] == 640
    assert b["kv_read"] == 896
    assert b["embeddings"] == 640
    assert b["logits"] == 800
    assert b["weights"] == 0
    assert b["total"] == 2976
    # batch 2: weights (61440+6400)*2 B * 2 output tokens / 2 = 135680
    assert rl.bytes_per_request(rl.ModelShape.from_config(TINY), 3, 2, batch=2)["weights"] == 135680


def test_tiny_roofline_bound_and_rate():
    c = rl.Ceilings(matmul_tflops=1e-6, copy_gbs=1e-6)  # 1e6 FLOP/s, 1e3 B/s
    r = rl.roofline(TINY, c, 3, 2)
    assert r["t_compute_s"] == pytest.approx(0.64384)
    assert r["t_memory_s"] == pytest.approx(2.976)
    assert r["bound"] == "memory"
    assert r["total_tokens_per_s"] == pytest.approx(5 / 2.976)
    assert r["output_tokens_per_s"] == pytest.approx(2 / 2.976)
    fast_mem = rl.Ceilings(matmul_tflops=1e-6, copy_gbs=1.0)
    assert rl.roofline(TINY, fast_mem, 3, 2)["bound"] == "compute"


def test_sliding_window_and_kv_sharing():
    cfg = dict(TINY, layer_types=["sliding_attention", "full_attention"], sliding_window=2)
    # layer 0 sees min(p, 2) keys: 1+2+2+2+2 = 9 -> 128*9; layer 1: 128*15
    assert rl.attention_flops(rl.ModelShape.from_config(cfg), 3, 2) == 128 * 9 + 128 * 15
    shared = dict(TINY, num_kv_shared_layers=1, use_double_wide_mlp=True, hidden_size_per_layer_input=8)
    p = rl.linear_params(rl.ModelShape.from_config(shared))
    # layer 0: 4096 + 2048 + 24576 + per-layer gate/proj 2*64*8 = 31744
    # layer 1 (KV-shared): no k/v, MLP 3*64*256 = 49152 -> 4096 + 49152 + 1024 = 54272
    assert p["per_layer"] == [31744, 54272]
    assert p["per_layer_model_projection"] == 64 * 2 * 8
    # only layer 0 writes a cache
    b = rl.bytes_per_request(rl.ModelShape.from_config(shared), 3, 2)
    assert b["kv_write"] == 64 * 5
    b2 = rl.bytes_per_request(rl.ModelShape.from_config(shared), 3, 2, count_shared_kv_reads=False)
    assert b2["kv_read"] == b["kv_read"] / 2


def test_e2b_counts():
    cfg = e2b_config()
    s = rl.ModelShape.from_config(cfg)
    p = rl.linear_params(s)
    # 12 own-KV sliding layers 36,175,872; 3 own-KV full 43,253,760; 16 shared sliding 63,700,992;
    # 4 shared full 69,992,448 (double-wide MLP 3*1536*12288 = 56,623,104 on shared layers)
    assert p["per_layer"][0] == 36175872
    assert p["per_layer"][4] == 43253760
    assert p["per_layer"][15] == 63700992
    assert p["per_layer"][19] == 69992448
    assert p["body"] == 12 * 36175872 + 3 * 43253760 + 16 * 63700992 + 4 * 69992448 + 1536 * 35 * 256
    assert p["body"] == 1876819968
    assert p["lm_head"] == 1536 * 262144
    f = rl.flops_per_request(s, 1024, 256)
    # a hand estimate: about 4.1 GFLOP per token
    assert f["total"] / 1280 == pytest.approx(4.0822e9, rel=1e-4)
    assert f["attention"] / 1280 == pytest.approx(167.46e6, rel=1e-3)


def test_e2b_ceiling_and_quarantine():
    cfg = e2b_config()
    c = rl.Ceilings(matmul_tflops=790.0, copy_gbs=4300.0)
    r = rl.roofline(cfg, c, 1024, 256)
    assert r["bound"] == "compute"
    assert r["total_tokens_per_s"] == pytest.approx(790e12 / 4.0822e9, rel=1e-3)  # ~193.5k
    # concurrency 16: weights re-read every step dominate -> memory-bound, ~67.7k tok/s
    r16 = rl.roofline(cfg, c, 1024, 256, batch=16)
    assert r16["bound"] == "memory"
    assert r16["total_tokens_per_s"] == pytest.approx(67745, rel=1e-3)
    # stock vLLM offline (46,948 tok/s): about 24% of the ceiling
    assert rl.fraction_of_ceiling(46948, cfg, c, 1024, 256) == pytest.approx(0.2426, abs=1e-3)
    assert not rl.quarantine(46948, cfg, c, 1024, 256)["quarantined"]
    q = rl.quarantine(250000, cfg, c, 1024, 256)
    assert q["quarantined"] and "ceiling" in q["reason"]
    assert rl.quarantine(float("nan"), cfg, c, 1024, 256)["quarantined"]
    assert not rl.quarantine(200000, cfg, c, 1024, 256, tolerance=1.1)["quarantined"]
    # prefill-heavy vs decode-heavy: longer outputs cost more per token (LM head, KV reads)
    assert rl.roofline(cfg, c, 8192, 128)["flops_per_token"] > 0
    assert math.isfinite(rl.ceiling_tokens_per_s(cfg, c, 512, 256))
