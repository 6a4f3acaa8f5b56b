#!/usr/bin/env python3
"""Write a seeded, margin-calibrated random-weight Gemma 4 checkpoint that vLLM 0.26 loads.

    python3 gpu/synth_ckpt.py MODEL_DIR OUT_DIR [--seed 0] [--emb-sigma 0.5]
        [--norm-scale 2.0] [--grid] [--report OUT.json]

Recipe (same idea as agent/world/checkpoint.py, self-contained: it needs only torch and transformers):
  1. transformers AutoModelForCausalLM.from_config(config) under torch.manual_seed(seed), bf16.
  2. Margin calibration, two documented knobs (both deterministic from the seed):
     - emb_sigma s: each row i of the (tied) token embedding is multiplied by
       exp(s*u_i - s^2), u_i ~ N(0,1) from a generator seeded with seed+1 (mean square of the
       factors is 1). A heavy tail of embedding norms makes the top-1 logit stand out from the
       262144-way crowd instead of being the maximum of i.i.d. Gaussians, whose top1-top2 gap is
       only about sigma/sqrt(2 ln V) (median ~0.11 nats with HF's init, against 0.1-0.16 estimated by hand).
     - norm_scale a: the final RMSNorm weight (init ones in Gemma 4) is multiplied by a, which
       scales all pre-softcap logits by a. Alone it cannot give large margins, because
       final_logit_softcapping=30 compresses the top of a Gaussian logit distribution.
     - post_norm_scale k: the weights of every post_attention_layernorm, post_feedforward_layernorm
       and post_per_layer_input_norm are multiplied by k, so the sub-layer outputs outweigh the
       input token's embedding in the residual stream. Without it, heavy-tailed embedding norms
       make free-running greedy repeat one token (tied embeddings: a large-norm input token
       predicts itself); on the H200 every emb_sigma > 0 point collapsed to ~1 unique token per 32.
       On a 5-layer CPU model, (0.5, 2, 16) kept 22 unique tokens per 32 with greedy margins of
       median 1.1 nats (k=1: 1.5 unique). Not yet run on the GPU.
     Defaults s=0.5, a=2.0 (a numpy model of the logits gave median ~1.5 nats); --target-median
     instead picks the grid point whose measured median is closest to the target. The measured
     distribution is printed and written to the report and to OUT_DIR/nightshift_synth.json.
  3. save_pretrained, then the K/V projection and k_norm tensors of the KV-shared layers are added
     (copied from the last non-shared layer of the same attention type) as one extra shard, since
     vLLM 0.26's loader expects them; vLLM does not use them at run time.
  4. A sha256 over the safetensors files (sorted names) identifies the checkpoint.
Margins: teacher-forced top1-top2 log-prob gaps at every position of seeded random token-id
prompts (<bos> + ids), computed with the HF model in bf16 (--grid also reports a small grid of
(s, a) without rebuilding the model). Run with transformers 5.14.1: 5.15 and later write a
config.json that vLLM 0.26 cannot read.
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import time

EXTRA_SHARD = "model-shared-kv.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja")
# (emb_sigma, norm_scale, post_norm_scale). The first eight ran on the H200 (commit 4e0f470); the
# post_norm_scale points were added after it, tested only on a 5-layer CPU model.
GRID = [(0.0, 1.0, 1.0), (0.0, 2.0, 1.0), (0.25, 2.0, 1.0), (0.5, 1.0, 1.0), (0.5, 2.0, 1.0), (0.75, 1.0, 1.0),
        (0.75, 1.5, 1.0), (1.0, 1.0, 1.0), (0.5, 2.0, 4.0), (0.5, 2.0, 16.0), (0.75, 1.5, 16.0), (1.0, 1.0, 16.0)]
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")


def add_shared_kv_tensors(d):
    """Add the tensors vLLM expects on the KV-shared layers; returns how many were added."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.load(open(os.path.join(d, "config.json")))
    n, shared = cfg["num_hidden_layers"], cfg.get("num_kv_shared_layers") or 0
    if not shared:
        return 0
    types, first = cfg["layer_types"], n - shared
    index_path = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(index_path)) if os.path.isfile(index_path) else None
    if index:
        where = index["weight_map"]
    else:
        where = {k: "model.safetensors" for k in safe_open(os.path.join(d, "model.safetensors"), "pt").keys()}
    files, extra = {}, {}
    for i in range(first, n):
        src = max(j for j in range(first) if types[j] == types[i])
        for w in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            name, src_name = f"model.layers.{i}.self_attn.{w}", f"model.layers.{src}.self_attn.{w}"
            if name in where or src_name not in where:
                continue
            fn = where[src_name]
            if fn not in files:
                files[fn] = safe_open(os.path.join(d, fn), "pt", device="cpu")
            extra[name] = files[fn].get_tensor(src_name).clone()
    if extra:
        save_file(extra, os.path.join(d, EXTRA_SHARD), metadata={"format": "pt"})
        if index:  # vLLM only reads the shards an index names
            index["weight_map"].update({k: EXTRA_SHARD for k in extra})
            with open(index_path, "w") as f:
                json.dump(index, f, indent=2)
    return len(extra)


def checkpoint_hash(d):
    h = hashlib.sha256()
    for fn in sorted(f for f in os.listdir(d) if f.endswith(".safetensors")):
        h.update(fn.encode())
        with open(os.path.join(d, fn), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def quantiles(xs):
    xs = sorted(xs)
    if not xs:
        return {}
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return {"n": len(xs), "p10": q(0.10), "median": q(0.50), "p90": q(0.90),
            "frac_below_0.1": sum(x < 0.1 for x in xs) / len(xs), "mean": sum(xs) / len(xs)}


def find_modules(model):
    """(embedding module, final norm module) of a Gemma 4 causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return model.get_input_embeddings(), base.norm


def row_factors(n_rows, sigma, seed, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    u = torch.randn(n_rows, generator=g, dtype=torch.float32)
    return torch.exp(sigma * u - sigma * sigma).to(device)


def post_norm_modules(model):
    return [m for name, m in model.named_modules() if name.split(".")[-1] in POST_NORMS and hasattr(m, "weight")]


def apply_knobs(model, emb0, norm0, sigma, scale, seed, post_scale=1.0, post0=None):
    """Set the knobs from the pristine copies (emb0, norm0, post0 = post-norm weights in
    post_norm_modules order)."""
    import torch

    emb, norm = find_modules(model)
    with torch.no_grad():
        for m, w0 in zip(post_norm_modules(model), post0 or []):
            m.weight.copy_((w0.float() * post_scale).to(w0.dtype))
        f = row_factors(emb0.shape[0], sigma, seed, emb0.device) if sigma else None
        emb.weight.copy_((emb0.float() * f[:, None]).to(emb0.dtype) if f is not None else emb0)
        norm.weight.copy_((norm0.float() * scale).to(norm0.dtype))


def measure_margins(model, vocab, n_prompts=8, length=128, seed=7, bos=2):
    """Teacher-forced top1-top2 log-prob margins at every position; also argmax diversity."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(4, vocab, (n_prompts, length), generator=g)
    ids[:, 0] = bos
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=ids.to(dev)).logits.float()
        lp = torch.log_softmax(logits, dim=-1)
        top = lp.topk(2, dim=-1)
    m = (top.values[..., 0] - top.values[..., 1]).flatten().tolist()
    arg = top.indices[..., 0]
    out = quantiles(m)
    out["distinct_argmax"] = int(arg.unique().numel())
    out["positions"] = int(arg.numel())
    out["top1_logprob_median"] = float(top.values[..., 0].median())
    return out


def measure_greedy(model, vocab, n_prompts=8, length=64, new_tokens=32, seed=9, bos=2):
    """Free-running greedy (HF generate): unique tokens per sequence and step margins."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(4, vocab, (n_prompts, length), generator=g)
    ids[:, 0] = bos
    dev = next(model.parameters()).device
    try:
        with torch.no_grad():
            out = model.generate(ids.to(dev), attention_mask=torch.ones_like(ids).to(dev), max_new_tokens=new_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0, eos_token_id=None)
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)[:300]}
    gen = out.sequences[:, length:]
    m = []
    for lg in out.logits:
        top = torch.log_softmax(lg.float(), dim=-1).topk(2, dim=-1).values
        m += (top[:, 0] - top[:, 1]).tolist()
    q = quantiles(m)
    return {"greedy_unique_per_seq": round(sum(len(set(r.tolist())) for r in gen) / n_prompts, 2),
            "greedy_distinct_seqs": len({tuple(r.tolist()) for r in gen}), "new_tokens": new_tokens,
            "greedy_margin_median": q.get("median"), "greedy_margin_p10": q.get("p10"), "greedy_margin_p90": q.get("p90")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", help="folder with config.json and tokenizer files")
    ap.add_argument("out_dir", help="checkpoint folder to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--emb-sigma", type=float, default=0.5, help="log-normal sigma of embedding row norms")
    ap.add_argument("--norm-scale", type=float, default=2.0, help="factor on the final norm weight")
    ap.add_argument("--post-norm-scale", type=float, default=1.0, help="factor on the sub-layer post-norm weights")
    ap.add_argument("--grid", action="store_true", help="also report margins over a small (sigma, scale) grid")
    ap.add_argument("--target-median", type=float, default=None,
                    help="pick (sigma, scale) from the grid whose median margin is closest to this (implies --grid)")
    ap.add_argument("--min-unique", type=float, default=8.0,
                    help="with --target-median: only grid points whose greedy outputs keep this many unique tokens per 32")
    ap.add_argument("--report", help="write a JSON report here")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--no-save", action="store_true", help="calibrate/report only")
    a = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) >= (5, 15):
        print(f"WARNING: transformers {transformers.__version__} writes a config.json that vLLM 0.26 "
              "cannot read; use 5.14.1")
    t = time.time()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = AutoConfig.from_pretrained(a.model_dir)
    torch.manual_seed(a.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    vocab = cfg.get_text_config().vocab_size if hasattr(cfg, "get_text_config") else cfg.vocab_size
    emb, norm = find_modules(model)
    emb0, norm0 = emb.weight.detach().clone(), norm.weight.detach().clone()
    post0 = [m.weight.detach().clone() for m in post_norm_modules(model)]
    report = {"seed": a.seed, "params": n, "transformers": transformers.__version__,
              "knobs": {"emb_sigma": a.emb_sigma, "norm_scale": a.norm_scale, "post_norm_scale": a.post_norm_scale},
              "margin_method": "teacher-forced, 8 seeded random token-id prompts x 128 positions, bf16 HF forward"}
    if a.grid or a.target_median is not None:
        report["grid"] = []
        for s, sc, k in GRID:
            apply_knobs(model, emb0, norm0, s, sc, a.seed, k, post0)
            r = measure_margins(model, vocab)
            r.update(measure_greedy(model, vocab))
            report["grid"].append({"emb_sigma": s, "norm_scale": sc, "post_norm_scale": k, **r})
            print(f"grid sigma={s:<5} scale={sc:<4} post={k:<4} median={r['median']:.3f} p10={r['p10']:.3f} "
                  f"p90={r['p90']:.3f} distinct_argmax={r['distinct_argmax']}/{r['positions']} "
                  f"greedy unique/seq={r.get('greedy_unique_per_seq')} margin med={r.get('greedy_margin_median')}", flush=True)
    if a.target_median is not None:
        # non-degenerate first: free-running greedy must keep at least min_unique distinct tokens
        # per 32-token sequence on average (tied embeddings + sharper logits favour self-repeats)
        ok = [r for r in report["grid"] if (r.get("greedy_unique_per_seq") or 0) >= a.min_unique] or report["grid"]
        best = min(ok, key=lambda r: (abs(math.log(max(r["median"], 1e-3) / a.target_median)),
                                      -r["distinct_argmax"]))
        a.emb_sigma, a.norm_scale, a.post_norm_scale = best["emb_sigma"], best["norm_scale"], best["post_norm_scale"]
        report["knobs"] = {"emb_sigma": a.emb_sigma, "norm_scale": a.norm_scale,
                           "post_norm_scale": a.post_norm_scale, "target_median": a.target_median}
        print(f"calibrated: sigma={a.emb_sigma} scale={a.norm_scale} (target median {a.target_median})")
    apply_knobs(model, emb0, norm0, a.emb_sigma, a.norm_scale, a.seed, a.post_norm_scale, post0)
    del emb0, norm0, post0
    report["margins"] = measure_margins(model, vocab)
    report["margins"].update(measure_greedy(model, vocab))
    print("chosen margins:", json.dumps(report["margins"]))
    if not a.no_save:
        model.save_pretrained(a.out_dir)
        for f in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(a.model_dir, f)):
                shutil.copy(os.path.join(a.model_dir, f), os.path.join(a.out_dir, f))
        del model
        report["shared_kv_tensors_added"] = add_shared_kv_tensors(a.out_dir)
        report["sha256"] = checkpoint_hash(a.out_dir)
        with open(os.path.join(a.out_dir, "nightshift_synth.json"), "w") as f:
            json.dump({k: v for k, v in report.items() if k != "grid"}, f, indent=2)
    report["seconds"] = round(time.time() - t, 1)
    print(f"synthetic checkpoint {a.out_dir}: {n / 1e9:.3f}B params, seed {a.seed}, {device}, "
          f"sigma {a.emb_sigma} scale {a.norm_scale}, sha256 {report.get('sha256', '-')[:16]}, {report['seconds']}s")
    if a.report:
        with open(a.report, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
