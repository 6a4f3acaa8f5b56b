#!/usr/bin/env python3
"""One offline vLLM engine: throughput (like `vllm bench throughput`) + greedy parity probe.

    python3 gpu/offline.py MODEL_DIR OUT.json [--mode plain|bi] [--tp-prompts 1000]
        [--input-len 1024] [--output-len 256] [--engine-args JSON] [--save-tokens F] [--compare-tokens F]

Engine: LLM(model, dtype=bfloat16, max_model_len=2048, seed=0, **engine_args), everything else at
vLLM's offline (LLM class) defaults. --mode bi sets VLLM_BATCH_INVARIANT=1 before vLLM is imported
and attention_backend=TRITON_ATTN.
Throughput: tp_prompts random token-id prompts of exactly input_len ids, SamplingParams(
temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len) as `vllm bench throughput`
does, all submitted in one llm.generate call after an 8-prompt warm-up; tokens/s over its wall time.
Parity probe: probe_prompts seeded random prompts (<bos> + 16..probe_max_len ids), greedy,
probe_tokens tokens, logprobs=2. Prefix cache reset before each pass. Passes: one batch (A), the
same batch again (B), then batches of small_batch (C). Margins: top1-top2 logprob at every
generated step of pass A (p10 / median / p90). --save-tokens writes pass A's tokens;
--compare-tokens counts identical sequences against a saved file (e.g. another engine config).
"""
import argparse
import json
import os
import random
import time


def quant(xs):
    xs = sorted(xs)
    if not xs:
        return {}
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return {"n": len(xs), "p10": round(q(0.1), 4), "median": round(q(0.5), 4), "p90": round(q(0.9), 4),
            "frac_below_0.1": round(sum(x < 0.1 for x in xs) / len(xs), 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out_json")
    ap.add_argument("--mode", choices=["plain", "bi"], default="plain")
    ap.add_argument("--tp-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--probe-prompts", type=int, default=64)
    ap.add_argument("--probe-max-len", type=int, default=1100)
    ap.add_argument("--probe-tokens", type=int, default=64)
    ap.add_argument("--small-batch", type=int, default=8)
    ap.add_argument("--engine-args", default="{}", help="JSON dict of extra LLM(...) arguments")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--save-tokens")
    ap.add_argument("--compare-tokens")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    extra = json.loads(a.engine_args)
    if a.mode == "bi":
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
        extra.setdefault("attention_backend", "TRITON_ATTN")
    t0 = time.time()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = json.load(open(os.path.join(a.model_dir, "config.json"))).get("vocab_size", 262144)
    llm = LLM(model=a.model_dir, load_format=a.load_format, dtype="bfloat16", max_model_len=2048, seed=0, **extra)
    res = {"tag": a.tag, "mode": a.mode, "engine_args": extra, "startup_s": round(time.time() - t0, 1),
           "env": {k: os.environ.get(k) for k in ("VLLM_BATCH_INVARIANT", "VLLM_USE_FLASHINFER_SAMPLER")}}
    try:
        sc = llm.llm_engine.vllm_config.scheduler_config
        res["max_num_batched_tokens"], res["max_num_seqs"] = sc.max_num_batched_tokens, sc.max_num_seqs
    except Exception as e:  # noqa: BLE001
        res["config_read_error"] = repr(e)
    print(f"[offline {a.tag}] engine up in {res['startup_s']}s", flush=True)

    def gen(prompts, sp, batch=None):
        batch = batch or len(prompts)
        outs = []
        for i in range(0, len(prompts), batch):
            outs += llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + batch]], sp, use_tqdm=False)
        return outs

    if a.tp_prompts:
        rng = random.Random(1234)
        prompts = [[rng.randrange(4, vocab) for _ in range(a.input_len)] for _ in range(a.tp_prompts)]
        sp = SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=a.output_len)
        gen(prompts[:8], sp)
        llm.reset_prefix_cache()
        t = time.time()
        outs = gen(prompts, sp)
        dt = time.time() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        res["throughput"] = {"prompts": a.tp_prompts, "input_len": a.input_len, "output_len": a.output_len,
                             "elapsed_s": round(dt, 2), "total_tok_s": round((n_in + n_out) / dt, 1),
                             "output_tok_s": round(n_out / dt, 1), "requests_s": round(a.tp_prompts / dt, 2)}
        print(f"[offline {a.tag}] throughput: {res['throughput']}", flush=True)

    rng = random.Random(7)
    probe = [[2] + [rng.randrange(4, vocab) for _ in range(rng.randrange(16, a.probe_max_len))]
             for _ in range(a.probe_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=a.probe_tokens, ignore_eos=True, logprobs=2)
    passes, outs_a = [], None
    for batch in (None, None, a.small_batch):
        llm.reset_prefix_cache()
        t = time.time()
        outs = gen(probe, sp, batch)
        passes.append(([list(o.outputs[0].token_ids) for o in outs], round(time.time() - t, 2)))
        outs_a = outs_a or outs
    margins = []
    for o in outs_a:
        for lp in o.outputs[0].logprobs or []:
            v = sorted((x.logprob for x in lp.values()), reverse=True)
            if len(v) > 1:
                margins.append(v[0] - v[1])
    A, B, C = (p[0] for p in passes)
    n = len(A)
    res["parity"] = {
        "prompts": n, "tokens_each": a.probe_tokens, "prompt_len_range": [17, a.probe_max_len],
        "repeat_identical": sum(x == y for x, y in zip(A, B)),
        f"batch{a.small_batch}_vs_batch{n}_identical": sum(x == y for x, y in zip(A, C)),
        "distinct_outputs": len({tuple(x) for x in A}),
        "mean_unique_tokens_per_seq": round(sum(len(set(x)) for x in A) / n, 2),
        "pass_s": [p[1] for p in passes],
        "margins": quant(margins),
        "first_tokens": A[0][:12],
    }
    if a.save_tokens:
        with open(a.save_tokens, "w") as f:
            json.dump({"tag": a.tag, "mode": a.mode, "engine_args": extra, "tokens": A}, f)
    if a.compare_tokens and os.path.isfile(a.compare_tokens):
        ref = json.load(open(a.compare_tokens))
        res["compare"] = {"against": ref.get("tag"), "against_engine_args": ref.get("engine_args"),
                          "identical": sum(x == y for x, y in zip(A, ref["tokens"])), "of": n}
    res["total_s"] = round(time.time() - t0, 1)
    print(f"[offline {a.tag}] parity: {json.dumps(res['parity'])}", flush=True)
    if "compare" in res:
        print(f"[offline {a.tag}] compare: {res['compare']}", flush=True)
    with open(a.out_json, "w") as f:
        json.dump(res, f, indent=2)
    del llm
    import gc
    gc.collect()


if __name__ == "__main__":
    main()
