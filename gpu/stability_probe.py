#!/usr/bin/env python3
"""Is a synthetic checkpoint chaotic? Two correct attention kernels (HF eager and SDPA, bf16) score the
same prompts; a stable network disagrees only at near-ties, a chaotic one everywhere by nats.

    python3 gpu/stability_probe.py CONFIG.json [--vocab 262144] [--layers 35] \
        --knobs final,post,qk,sigma [--knobs ...]

Each knob point (final_norm_scale, post_norm_scale, qk_norm_scale, embedding_norm_sigma; see
agent/world/checkpoint.py) prints the top-1 agreement, the deficit of one kernel's top-1 under the other
(median, max), the median top-1/top-2 margin, and unique tokens per 32 of free-running greedy output.
Runs on a CPU (2.2B parameters at vocab 32768 fit in a few GB; the full E2B vocab needs about 10 GB).
"""
import argparse
import json
import os
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM

POST = ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")


def build(config_path, vocab, layers, seed=0):
    cfg = json.load(open(config_path))
    cfg["vocab_size"] = cfg["vocab_size_per_layer_input"] = vocab
    shared = cfg.get("num_kv_shared_layers") or 0
    cfg["num_kv_shared_layers"] = shared * layers // cfg["num_hidden_layers"]
    cfg["num_hidden_layers"], cfg["layer_types"] = layers, cfg["layer_types"][:layers]
    folder = tempfile.mkdtemp()
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)


class Knobs:
    def __init__(self, model, seed=0):
        self.model, self.now = model, (1.0, 1.0, 1.0, 0.0)
        self.z = torch.randn(model.get_input_embeddings().weight.shape[0],
                             generator=torch.Generator().manual_seed(seed + 1))

    @torch.no_grad()
    def set(self, final, post, qk, sigma):
        f0, p0, q0, s0 = self.now
        emb = self.model.get_input_embeddings().weight
        emb.copy_((emb.float() * torch.exp((sigma - s0) * self.z - (sigma**2 - s0**2))[:, None]).to(emb.dtype))
        self.model.get_decoder().norm.weight.mul_(final / f0)
        for name, module in self.model.named_modules():
            leaf, weight = name.rsplit(".", 1)[-1], getattr(module, "weight", None)
            if weight is not None and leaf in POST:
                weight.mul_(post / p0)
            if weight is not None and leaf in ("q_norm", "k_norm"):
                weight.mul_(qk / q0)
        self.now = (final, post, qk, sigma)


@torch.no_grad()
def logprobs(model, ids, impl):
    for module in model.modules():
        if hasattr(module, "config"):
            module.config._attn_implementation = impl
    return torch.log_softmax(model(input_ids=ids).logits.float(), -1)


def compare(a, b):
    top_a = a.argmax(-1)
    deficit = b.max(-1).values - b.gather(-1, top_a[..., None])[..., 0]
    top2 = b.topk(2, -1).values
    return {"top1_agreement": round((b.argmax(-1) == top_a).float().mean().item(), 3),
            "deficit_p50": round(deficit.median().item(), 3), "deficit_max": round(deficit.max().item(), 3),
            "margin_p50": round((top2[..., 0] - top2[..., 1]).median().item(), 3)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--layers", type=int, default=35)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--knobs", action="append", required=True, help="final,post,qk,sigma")
    a = p.parse_args()
    model = build(a.config, a.vocab, a.layers)
    knobs = Knobs(model)
    ids = torch.randint(4, a.vocab, (a.prompts, 64), generator=torch.Generator().manual_seed(2))
    for point in a.knobs:
        knobs.set(*map(float, point.split(",")))
        row = compare(logprobs(model, ids, "eager"), logprobs(model, ids, "sdpa"))
        with torch.no_grad():
            out = model.generate(input_ids=ids[:, :16], max_new_tokens=32, do_sample=False)[:, 16:]
        row["unique_per_32"] = [len(set(r.tolist())) for r in out]
        print(json.dumps({"knobs": point, **row}), flush=True)


if __name__ == "__main__":
    main()
