"""Roofline for decoder-only serving, from a Gemma 4 style Hugging Face config.

Pure Python (no torch). Inputs: the config.json dict (a multimodal config's ``text_config`` is
used if present) and the GPU's *measured* ceilings (bf16 matmul TFLOP/s, device copy GB/s).

Model of one request with ``input_len`` prompt tokens and ``output_len`` generated tokens:

FLOPs (2 per multiply-add)
  * every token (prompt and generated) goes through every linear layer except the LM head:
    q/o projections, k/v projections of the layers that own a KV cache (the last
    ``num_kv_shared_layers`` reuse an earlier layer's cache and have none), the gated MLP
    (``intermediate_size``, doubled on the KV-shared layers when ``use_double_wide_mlp``), the
    per-layer-input gate/projection (``hidden_size_per_layer_input``) and the model-level
    per-layer projection;
  * the LM head (``hidden_size x vocab_size``) only for the ``output_len`` positions that are
    sampled (vLLM computes logits for the last prompt position and each decode step);
  * attention: QK^T and PV, 4 * heads * head_dim FLOPs per visible key, causal, with keys capped
    at ``sliding_window`` on sliding layers (head_dim = ``global_head_dim`` on full layers).
  Element-wise work (norms, activations, rotary, softcap) is left out: it is not matmul work.

Bytes (the fewest that must cross device memory; activations between kernels are not counted)
  * weights: one read of all linear weights per engine step; with ``batch`` sequences decoding
    together, a request's share is ``output_len / batch`` reads (prefill is assumed to ride in the
    same steps). ``batch=None`` means infinite batch: weights fully amortised;
  * KV cache: written once per token on the layers that own a cache; read at every decode step
    by every layer (KV-shared layers read their source layer's cache again), plus one read of the
    prompt's KV during prefill; ``count_shared_kv_reads=False`` drops the shared layers' re-reads;
  * embeddings: one row of ``embed_tokens`` and of ``embed_tokens_per_layer`` per token;
  * logits: one write and one read of ``vocab_size`` values (bf16) per sampled token.

Ceiling: time per request >= max(FLOPs / matmul rate, bytes / copy bandwidth); tokens/s ceiling =
(input_len + output_len) / that time (``output_len / time`` for output tokens/s). This is an
optimistic bound (perfect overlap, no scheduling gaps), so a measured throughput above
``quarantine_ceiling`` (infinite batch, no shared-KV re-reads) is physically implausible:
``quarantine`` flags it and such a candidate must never be accepted.

For Gemma 4 E2B (config in tasks/models/gemma-4-e2b) and 1024 in / 256 out this gives
4.08 GFLOP per total token (3.75 GFLOP of linear work per token, 0.81 GFLOP of LM head per
output token, 0.17 GFLOP of attention per token on average); a hand estimate gave about 4.1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class Ceilings:
    """Measured GPU ceilings: bf16 dense matmul rate and device-to-device copy bandwidth
    (bytes read + bytes written per second)."""

    matmul_tflops: float
    copy_gbs: float

    @property
    def flops_per_s(self) -> float:
        return self.matmul_tflops * 1e12

    @property
    def bytes_per_s(self) -> float:
        return self.copy_gbs * 1e9


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    global_head_dim: int
    vocab: int
    layer_types: tuple
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_input: int = 0
    vocab_per_layer_input: int = 0
    sliding_window: Optional[int] = None
    tie_word_embeddings: bool = True
    dtype_bytes: int = 2
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], dtype_bytes: int = 2) -> "ModelShape":
        c = cfg.get("text_config") or cfg
        layers = int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        head_dim = int(c.get("head_dim") or hidden // heads)
        types = tuple(c.get("layer_types") or ["full_attention"] * layers)
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        return cls(
            hidden=hidden,
            intermediate=int(c["intermediate_size"]),
            layers=layers,
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            global_head_dim=int(c.get("global_head_dim") or head_dim),
            vocab=int(c["vocab_size"]),
            layer_types=types,
            kv_shared_layers=int(c.get("num_kv_shared_layers") or 0),
            double_wide_mlp=bool(c.get("use_double_wide_mlp")),
            per_layer_input=int(c.get("hidden_size_per_layer_input") or 0),
            vocab_per_layer_input=int(c.get("vocab_size_per_layer_input") or c["vocab_size"]),
            sliding_window=c.get("sliding_window"),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
            dtype_bytes=dtype_bytes,
        )

    # -- per-layer facts --------------------------------------------------------------------
    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention" and self.sliding_window is not None

    def layer_head_dim(self, i: int) -> int:
        return self.head_dim if self.is_sliding(i) else self.global_head_dim

    def owns_kv(self, i: int) -> bool:
        return i < self.layers - self.kv_shared_layers

    def layer_intermediate(self, i: int) -> int:
        return self.intermediate * (2 if (self.double_wide_mlp and not self.owns_kv(i)) else 1)

    def visible_keys(self, i: int, position: int) -> int:
        """Keys a query at 1-based ``position`` attends to on layer i."""
        return min(position, self.sliding_window) if self.is_sliding(i) else position


def linear_params(shape: ModelShape) -> dict:
    """Matmul weight counts: ``body`` (applied to every token) and ``lm_head`` (sampled tokens)."""
    d, body = shape.hidden, 0
    per_layer = []
    for i in range(shape.layers):
        hd = shape.layer_head_dim(i)
        q_o = 2 * d * shape.heads * hd
        kv = 2 * d * shape.kv_heads * hd if shape.owns_kv(i) else 0
        mlp = 3 * d * shape.layer_intermediate(i)
        pli = 2 * d * shape.per_layer_input
        per_layer.append(q_o + kv + mlp + pli)
    body = sum(per_layer)
    model_pli = d * shape.layers * shape.per_layer_input  # per_layer_model_projection
    return {"layers": body, "per_layer_model_projection": model_pli, "body": body + model_pli,
            "lm_head": d * shape.vocab, "per_layer": per_layer}


def _sum_visible(shape: ModelShape, i: int, first: int, last: int) -> int:
    """Sum over positions first..last (1-based, inclusive) of visible keys on layer i."""
    if last < first:
        return 0
    w = shape.sliding_window if shape.is_sliding(i) else None

    def tri(n):  # sum of min(p, w) for p = 1..n
        if w is None or n <= w:
            return n * (n + 1) // 2
        return w * (w + 1) // 2 + (n - w) * w

    return tri(last) - tri(first - 1)


def attention_flops(shape: ModelShape, input_len: int, output_len: int) -> int:
    """QK^T + PV FLOPs of one request, causal, prefill and decode."""
    total_positions = input_len + output_len
    f = 0
    for i in range(shape.layers):
        f += 4 * shape.heads * shape.layer_head_dim(i) * _sum_visible(shape, i, 1, total_positions)
    return f


def flops_per_request(shape: ModelShape, input_len: int, output_len: int) -> dict:
    p = linear_params(shape)
    n = input_len + output_len
    body = 2 * p["body"] * n
    head = 2 * p["lm_head"] * output_len
    attn = attention_flops(shape, input_len, output_len)
    return {"body": body, "lm_head": head, "attention": attn, "total": body + head + attn}


def kv_bytes_per_token(shape: ModelShape, layer: int) -> int:
    """K and V of one token on one layer's cache."""
    return 2 * shape.kv_heads * shape.layer_head_dim(layer) * shape.dtype_bytes


def weight_bytes(shape: ModelShape) -> int:
    p = linear_params(shape)
    return (p["body"] + p["lm_head"]) * shape.dtype_bytes


def bytes_per_request(shape: ModelShape, input_len: int, output_len: int, batch: Optional[int] = None,
                      count_shared_kv_reads: bool = True) -> dict:
    b = shape.dtype_bytes
    n = input_len + output_len
    kv_write = sum(kv_bytes_per_token(shape, i) for i in range(shape.layers) if shape.owns_kv(i)) * n
    kv_read = 0
    for i in range(shape.layers):
        if not shape.owns_kv(i) and not count_shared_kv_reads:
            continue
        per = kv_bytes_per_token(shape, i)
        # decode step k (k = 1..output_len-1) attends from position input_len + k; the first
        # output token comes from the prefill's last position
        kv_read += per * _sum_visible(shape, i, input_len + 1, input_len + output_len - 1)
        kv_read += per * (min(input_len, shape.sliding_window) if shape.is_sliding(i) else input_len)
    emb = (shape.hidden + shape.layers * shape.per_layer_input) * b * n
    logits = 2 * shape.vocab * b * output_len
    weights = 0.0 if not batch else weight_bytes(shape) * output_len / batch
    total = kv_write + kv_read + emb + logits + weights
    return {"kv_write": kv_write, "kv_read": kv_read, "embeddings": emb, "logits": logits,
            "weights": weights, "total": total}


def roofline(config: Mapping[str, Any], ceilings: Ceilings, input_len: int, output_len: int,
             batch: Optional[int] = None, count_shared_kv_reads: bool = True) -> dict:
    """Ceiling tokens/s for a workload of requests with input_len prompt and output_len new tokens.

    ``batch``: sequences decoding together (weights read once per step); None = infinite."""
    if input_len < 1 or output_len < 1:
        raise ValueError("input_len and output_len must be >= 1")
    shape = ModelShape.from_config(config)
    f = flops_per_request(shape, input_len, output_len)
    by = bytes_per_request(shape, input_len, output_len, batch, count_shared_kv_reads)
    t_compute = f["total"] / ceilings.flops_per_s
    t_memory = by["total"] / ceilings.bytes_per_s
    t = max(t_compute, t_memory)
    n = input_len + output_len
    return {
        "input_len": input_len, "output_len": output_len, "batch": batch,
        "flops_per_request": f["total"], "flops_per_token": f["total"] / n,
        "flops_breakdown": {k: v for k, v in f.items() if k != "total"},
        "bytes_per_request": by["total"], "bytes_per_token": by["total"] / n,
        "bytes_breakdown": {k: v for k, v in by.items() if k != "total"},
        "t_compute_s": t_compute, "t_memory_s": t_memory,
        "bound": "compute" if t_compute >= t_memory else "memory",
        "total_tokens_per_s": n / t, "output_tokens_per_s": output_len / t,
        "ceilings": {"matmul_tflops": ceilings.matmul_tflops, "copy_gbs": ceilings.copy_gbs},
    }


def ceiling_tokens_per_s(config, ceilings: Ceilings, input_len: int, output_len: int,
                         batch: Optional[int] = None) -> float:
    """Total (prompt + generated) tokens/s ceiling."""
    return roofline(config, ceilings, input_len, output_len, batch)["total_tokens_per_s"]


def quarantine_ceiling(config, ceilings: Ceilings, input_len: int, output_len: int) -> float:
    """The most optimistic ceiling (infinite batch, no KV-shared re-reads): nothing real beats it."""
    return roofline(config, ceilings, input_len, output_len, None, count_shared_kv_reads=False)["total_tokens_per_s"]


def fraction_of_ceiling(measured_total_tok_s: float, config, ceilings: Ceilings, input_len: int,
                        output_len: int, batch: Optional[int] = None) -> float:
    return measured_total_tok_s / ceiling_tokens_per_s(config, ceilings, input_len, output_len, batch)


def quarantine(measured_total_tok_s: float, config, ceilings: Ceilings, input_len: int, output_len: int,
               tolerance: float = 1.0) -> dict:
    """Flag a throughput claim above the roofline. ``tolerance`` > 1 allows for ceilings measured a
    little under the true peak; a flagged candidate is quarantined, never accepted."""
    ceiling = quarantine_ceiling(config, ceilings, input_len, output_len)
    frac = measured_total_tok_s / ceiling
    flagged = not (measured_total_tok_s > 0) or frac > tolerance
    reason = None
    if flagged:
        reason = ("non-positive or NaN throughput" if not (measured_total_tok_s > 0) else
                  f"measured {measured_total_tok_s:.0f} tok/s is {frac:.2f}x the roofline ceiling {ceiling:.0f} tok/s")
    return {"quarantined": flagged, "fraction_of_ceiling": frac, "ceiling_tokens_per_s": ceiling,
            "tolerance": tolerance, "reason": reason}
