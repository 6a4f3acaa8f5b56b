#!/usr/bin/env python3
"""Print a short table of whatever results exist in RESULT_DIR (while the measurements run, or after)."""
import json
import os
import sys


def load(d, f):
    p = os.path.join(d, f)
    try:
        return json.load(open(p)) if os.path.isfile(p) else None
    except ValueError:
        return None


def main():
    d = sys.argv[1]
    rows = []
    c = load(d, "ceilings.json") or load(os.path.dirname(d.rstrip("/")), "ceilings.json")
    if c:
        rows.append(f"ceilings: matmul {c['bf16_matmul_tflops']} TFLOP/s, copy {c['copy_gbs']} GB/s")
    s = load(d, "synth.json")
    if s:
        m = s["margins"]
        rows.append(f"synth: knobs {s['knobs']} margins p10 {m['p10']:.3f} med {m['median']:.3f} p90 {m['p90']:.3f} "
                    f"distinct argmax {m['distinct_argmax']}/{m['positions']} sha {s.get('sha256', '')[:12]} {s.get('seconds')}s")
        for g in s.get("grid", []):
            rows.append(f"  grid s={g['emb_sigma']} a={g['norm_scale']}: med {g['median']:.3f} p10 {g['p10']:.3f} "
                        f"p90 {g['p90']:.3f} distinct {g['distinct_argmax']}")
    for f in ("off_plain.json", "off_bi8k.json", "off_bi16k.json"):
        o = load(d, f)
        if not o:
            continue
        tp = o.get("throughput") or {}
        p = o.get("parity") or {}
        keys = [k for k in p if k.startswith("batch")]
        rows.append(f"{o['tag']}: up {o['startup_s']}s mnbt {o.get('max_num_batched_tokens')} seqs {o.get('max_num_seqs')} | "
                    f"tp {tp.get('total_tok_s')} tot/s {tp.get('output_tok_s')} out/s ({tp.get('elapsed_s')}s) | "
                    f"repeat {p.get('repeat_identical')}/{p.get('prompts')} {keys[0] if keys else ''} "
                    f"{p.get(keys[0]) if keys else ''} distinct {p.get('distinct_outputs')} margins {p.get('margins')} "
                    f"compare {o.get('compare')}")
    v = load(d, "serve.json")
    if v:
        rows.append(f"serve base startup {v.get('base_startup_s')}s")
        for r in (v.get("stock") or []) + (v.get("diag") or []) + (v.get("flags_runs") or []):
            rows.append("  " + " ".join(f"{k}={r.get(k)}" for k in (
                "tag", "total_token_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms",
                "server_itl_ms", "server_ttft_ms", "tokens_per_step", "engine_steps", "wall_s") if k in r))
        if v.get("flags_summary"):
            rows.append(f"flags: {json.dumps(v['flags_summary'])}")
        if v.get("flags_parity_sequential_same_batches"):
            rows.append(f"seq parity: {v['flags_parity_sequential_same_batches']}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
