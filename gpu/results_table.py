#!/usr/bin/env python3
"""Turn a result folder of the baseline measurements (benchmarks/README.md) into
benchmarks/results/h200-gemma4-e2b.json, with roofline fractions from gpu/roofline.py.

    python3 gpu/results_table.py RES_DIR [--config tasks/models/gemma-4-e2b/config.json] [--out benchmarks/results]
        [--gpu-seconds S]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import roofline as rl  # noqa: E402


def load(d, f):
    p = os.path.join(d, f)
    return json.load(open(p)) if os.path.isfile(p) else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("res")
    ap.add_argument("--config", default=os.path.join(HERE, "..", "tasks", "models", "gemma-4-e2b", "config.json"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "benchmarks", "results"))
    ap.add_argument("--gpu-seconds", type=float, default=None, help="GPU time the measurements took, recorded as is")
    a = ap.parse_args()
    cfg = json.load(open(a.config))
    c = load(a.res, "ceilings.json")
    ceil = rl.Ceilings(c["bf16_matmul_tflops"], c["copy_gbs"])
    I, O = 1024, 256
    inf = rl.roofline(cfg, ceil, I, O)
    out = {"device": c["device"], "date": "2026-11-29", "vllm": "0.26.0", "transformers": "5.14.1",
           "torch": c["torch"], "model": "Gemma 4 E2B text (Gemma4ForCausalLM), synthetic weights",
           "ceilings": c,
           "roofline": {"input_len": I, "output_len": O, "flops_per_token": inf["flops_per_token"],
                        "flops_breakdown_per_request": inf["flops_breakdown"],
                        "bytes_per_token_infinite_batch": inf["bytes_per_token"],
                        "ceiling_total_tok_s_infinite_batch": inf["total_tokens_per_s"],
                        "ceiling_output_tok_s_infinite_batch": inf["output_tokens_per_s"],
                        "bound_infinite_batch": inf["bound"],
                        "quarantine_ceiling_total_tok_s": rl.quarantine_ceiling(cfg, ceil, I, O)},
           "gpu_seconds_used": a.gpu_seconds}
    s = load(a.res, "synth.json")
    if s:
        out["synthetic_checkpoint"] = {k: s.get(k) for k in ("seed", "params", "knobs", "sha256", "seconds",
                                                              "shared_kv_tensors_added", "margins", "grid",
                                                              "margin_method", "transformers")}
    offl = {}
    for f in ("off_plain.json", "off_bi8k.json", "off_bi16k.json"):
        o = load(a.res, f)
        if not o:
            continue
        tp = o.get("throughput")
        if tp:
            tp["fraction_of_ceiling"] = tp["total_tok_s"] / inf["total_tokens_per_s"]
        offl[o["tag"]] = o
    out["offline"] = offl
    v = load(a.res, "serve.json") or {}
    rows = []
    for r in (v.get("stock") or []) + (v.get("diag") or []):
        conc = r.get("concurrency") or None
        r = dict(r)
        r["fraction_of_ceiling_infinite_batch"] = r["total_token_throughput"] / inf["total_tokens_per_s"]
        if conc:
            r["ceiling_at_batch_eq_concurrency"] = rl.ceiling_tokens_per_s(cfg, ceil, I, O, batch=conc)
            r["fraction_of_ceiling_at_batch"] = r["total_token_throughput"] / r["ceiling_at_batch_eq_concurrency"]
        rows.append(r)
    out["serve"] = {"startup_s": v.get("flags_startup_s") or {"base": v.get("base_startup_s")},
                    "runs": rows, "flags_runs": v.get("flags_runs"), "flags_summary": v.get("flags_summary"),
                    "flags_parity_sequential_same_batches": v.get("flags_parity_sequential_same_batches")}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "h200-gemma4-e2b.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({"ceiling": inf["total_tokens_per_s"], "flops_per_token": inf["flops_per_token"]}))
    for r in rows:
        print(r["tag"], round(r["total_token_throughput"]), round(r["fraction_of_ceiling_infinite_batch"], 3),
              r.get("ceiling_at_batch_eq_concurrency") and round(r["ceiling_at_batch_eq_concurrency"]),
              r.get("fraction_of_ceiling_at_batch") and round(r["fraction_of_ceiling_at_batch"], 3))
    for k, o in offl.items():
        print(k, o.get("throughput"))


if __name__ == "__main__":
    main()
