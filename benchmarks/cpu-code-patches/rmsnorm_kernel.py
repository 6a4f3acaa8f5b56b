"""What 03-rmsnorm-cpu-kernel.patch does to the CPU task's model, in one offline engine (no server):
its speed on the benchmark's workload, native and kernel norms alternating in the same process, and how
many sequential greedy outputs (parity's regime) it changes.

    python benchmarks/cpu-code-patches/rmsnorm_kernel.py [--pairs 6] [--prompts 96] [--tokens 16] [--exact | --overheads]

`--exact` measures instead the exact form of 04: the native arithmetic without the IR dispatch chain, with the
epsilon and the row length as float32 0-dim tensors made once. `--overheads` measures 05 (the arithmetic of
05-cpu-exact-overheads.patch, switched on and off in one process).

The model is the task's synthetic checkpoint (`nightshift run` or `nightshift checkout` makes it)."""
import argparse
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model runs in this process
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from vllm.model_executor.layers import layernorm  # noqa: E402

NATIVE = layernorm.RMSNorm.forward_cpu
USE_KERNEL = {"on": False}


def kernel_norm(self, x, residual=None):
    """The patch's RMSNorm.forward_cpu, switchable."""
    if (not USE_KERNEL["on"] or residual is not None or self.variance_size_override is not None
            or x.dtype not in (torch.bfloat16, torch.float16) or self.weight.dtype != x.dtype):
        return NATIVE(self, x, residual)
    unit = getattr(self, "_cpu_unit_weight", None)
    if unit is None:
        unit = self._cpu_unit_weight = torch.ones(x.shape[-1], dtype=x.dtype)
    x = x.contiguous()
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, unit, self.variance_epsilon)
    if self.pass_weight:
        out.mul_(self.weight.data)
    return out


def exact_norm(self, x, residual=None):
    """The native arithmetic op for op (the same float32 values enter the same kernels), without the two 0-dim
    conversions a call (`mean`'s division by the row length, `+ epsilon`) and without the IR dispatch chain."""
    if not USE_KERNEL["on"] or residual is not None or self.variance_size_override is not None:
        return NATIVE(self, x, residual)
    consts = self.__dict__.get("_exact_consts")
    if consts is None:
        consts = self.__dict__["_exact_consts"] = (torch.tensor(self.variance_epsilon, dtype=torch.float32),
                                                   torch.tensor(float(x.shape[-1]), dtype=torch.float32))
    eps, n = consts
    orig = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).sum(dim=-1, keepdim=True).div_(n) + eps)
    if self.pass_weight:
        xf = xf.to(self.weight.dtype) * self.weight.data
    return xf.to(orig)


layernorm.RMSNorm.forward_cpu = kernel_norm


def install_overheads() -> None:
    """05-cpu-exact-overheads.patch as switchable replacements (its arithmetic, for an A/B in one engine)."""
    import torch.nn.functional as F
    from vllm.model_executor.layers import activation, linear
    from vllm.model_executor.models import gemma4
    on = lambda: USE_KERNEL["on"]  # noqa: E731

    def norm(self, x, residual=None):
        if not on() or residual is not None or self.variance_size_override is not None or x.dtype != self.weight.dtype:
            return NATIVE(self, x, residual)
        out = F.rms_norm(x, (x.shape[-1],), None, self.variance_epsilon)
        return out.mul_(self.weight.data) if self.pass_weight else out

    native_attn = gemma4.Gemma4Attention.forward

    def attn(self, positions, hidden_states, **kwargs):
        if not on() or self.is_kv_shared_layer:
            return native_attn(self, positions, hidden_states, **kwargs)
        qkv, _ = self.qkv_proj(hidden_states)
        n = qkv.shape[0]
        heads = F.rms_norm(qkv.view(n, -1, self.head_dim), (self.head_dim,), None, self.q_norm.variance_epsilon)
        heads[:, :self.num_heads].mul_(self.q_norm.weight.data)
        heads[:, self.num_heads:self.num_heads + self.num_kv_heads].mul_(self.k_norm.weight.data)
        q, k, v = (t.contiguous() for t in heads.view(n, -1).split([self.q_size, self.kv_size, self.kv_size], -1))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))[0]

    native_gelu = activation.GeluAndMul.forward_cpu

    def gelu(self, x):
        if not on():
            return native_gelu(self, x)
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate).mul_(x[..., d:])

    native_layer = gemma4.Gemma4DecoderLayer.forward

    def layer(self, positions, hidden_states, residual, per_layer_input=None, **kwargs):
        if not on():
            return native_layer(self, positions, hidden_states, residual, per_layer_input, **kwargs)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(self.self_attn(
            positions=positions, hidden_states=self.input_layernorm(residual), **kwargs)) + residual
        residual = hidden_states
        hidden_states = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden_states)))
        hidden_states = hidden_states + residual
        if per_layer_input is not None and self.per_layer_input_gate is not None:
            gate = F.gelu(self.per_layer_input_gate(hidden_states), approximate="tanh").mul_(per_layer_input)
            hidden_states = hidden_states + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        unit = self.__dict__.get("_unit_layer_scalar")  # known once the weights are loaded, as in the patch
        if unit is None:
            unit = self.__dict__["_unit_layer_scalar"] = bool((self.layer_scalar == 1).all())
        if not unit:
            hidden_states = hidden_states * self.layer_scalar
        return hidden_states, None

    native_apply = linear.UnquantizedLinearMethod.apply

    def apply(self, layer, x, bias=None):
        return layer.cpu_linear(x, layer.weight, bias) if on() else native_apply(self, layer, x, bias)

    layernorm.RMSNorm.forward_cpu = norm
    gemma4.Gemma4Attention.forward = attn
    activation.GeluAndMul.forward_cpu = gelu
    gemma4.Gemma4DecoderLayer.forward = layer
    linear.UnquantizedLinearMethod.apply = apply


def model_path() -> Path:
    from agent.world.paths import cache_root

    found = sorted((cache_root() / "models").glob("synthetic-*"))
    if not found:
        raise SystemExit(f"no synthetic checkpoint under {cache_root() / 'models'}: run `nightshift run` first")
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=96, help="sequential prompts for the divergence count")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per sequential prompt")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--exact", action="store_true", help="04, the exact norm, instead of the C++ kernel")
    which.add_argument("--overheads", action="store_true", help="05, the exact overhead cuts, instead")
    args = parser.parse_args()
    if args.exact:
        layernorm.RMSNorm.forward_cpu = exact_norm
    if args.overheads:
        install_overheads()
    from vllm import LLM, SamplingParams
    rng = random.Random(0)

    def prompts(n, length):
        return [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(length)]} for _ in range(n)]

    # the benchmark's workload: 32 prompts of 64 tokens, 32 out, at the task's max_num_seqs 4
    llm = LLM(model=str(model_path()), dtype="bfloat16", max_model_len=512, max_num_seqs=4, enforce_eager=True,
              enable_prefix_caching=False)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm.generate(prompts(8, 64), greedy, use_tqdm=False)
    seconds = {False: [], True: []}
    for pair in range(args.pairs):
        for kernel in ((False, True) if pair % 2 == 0 else (True, False)):
            USE_KERNEL["on"] = kernel
            batch = prompts(32, 64)
            started = time.perf_counter()
            llm.generate(batch, greedy, use_tqdm=False)
            seconds[kernel].append(time.perf_counter() - started)
    ratios = [a / b for a, b in zip(seconds[False], seconds[True])]
    print(f"native s: {[round(s, 3) for s in seconds[False]]}")
    print(f"{'overheads' if args.overheads else 'exact' if args.exact else 'kernel'} s: {[round(s, 3) for s in seconds[True]]}")
    print(f"speedup per pair: {[round(r, 3) for r in ratios]}; median {statistics.median(ratios):.3f}")
    del llm

    # parity's regime: one request at a time
    llm = LLM(model=str(model_path()), dtype="bfloat16", max_model_len=512, max_num_seqs=1, enforce_eager=True,
              enable_prefix_caching=False)
    batch = prompts(args.prompts, 32)
    outputs = {}
    for kernel in (False, True):
        USE_KERNEL["on"] = kernel
        outputs[kernel] = [o.outputs[0].token_ids for o in llm.generate(
            batch, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True), use_tqdm=False)]
    changed = [(i, next(j for j, (a, b) in enumerate(zip(x, y)) if a != b))
               for i, (x, y) in enumerate(zip(outputs[False], outputs[True])) if x != y]
    rate = len(changed) / args.prompts
    print(f"sequential outputs changed: {len(changed)} of {args.prompts} (prompt, first position): {changed}")
    for n in (8, 32, 64):
        print(f"  parity of {n} prompts x {args.tokens} tokens passes it with probability {(1 - rate) ** n:.3f}")


if __name__ == "__main__":
    main()
