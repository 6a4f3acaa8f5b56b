"""Seeded synthetic checkpoints: real random weights (not vLLM's degenerate dummy load), cached.

The folder is keyed by (config, seed, logit_scale, recipe) and identified in the trace by the
sha256 of its weight files. With real weights on disk, the task points at them instead.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from pydantic import BaseModel, Field

from agent.world.numerics import Margins
from agent.world.paths import cache_root
from traces.errors import NightshiftError
from traces.schema import CheckpointWritten

RECIPE = "hf-from-config-v1"
KNOB_DEFAULTS = {"logit_scale": 1.0, "final_norm_scale": 1.0, "post_norm_scale": 1.0, "embedding_norm_sigma": 0.0,
                 "qk_norm_scale": 1.0}
MANIFEST = "nightshift-checkpoint.json"
SHARED_KV_SHARD = "model-shared-kv.safetensors"
SPECIAL_TOKENS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>"}


class ModelError(NightshiftError, FileNotFoundError):
    """The task's model folder or synthetic config is missing or unreadable."""

    stage = "model"


class CheckpointInfo(BaseModel):
    path: Path
    sha256: str
    params: int = 0
    seed: int | None = None
    knobs: dict[str, float] = {}
    init_device: str = "cpu"
    """Where the seeded initialisation ran: the same seed gives other weights on a GPU than on a CPU."""
    margins: Margins | None = None
    seconds: float = 0.0
    written: CheckpointWritten | None = None
    """How it was written (None: real weights, or a synthetic one cached before this was recorded)."""
    cached: bool = Field(False, exclude=True)
    """Found in the cache rather than written now (not stored in its manifest)."""

    def describe(self) -> str:
        """One line for `nightshift run`: the weights, and for a synthetic checkpoint how they were written."""
        if self.written is None:
            return f"model {self.path}: sha256 {self.sha256[:16]}" + ("" if self.seed is None else
                                                                      f", seed {self.seed} (how it was written: "
                                                                      f"not recorded)")
        how = "cached" if self.cached else f"written in {self.seconds:.0f} s"
        return f"synthetic model {self.path.name} ({how}): {self.written.describe()}"


def writing_environment(device: str, dtype: str) -> CheckpointWritten:
    """What decides the bytes a seeded initialisation writes, on this host."""
    import platform

    import numpy
    import safetensors
    import torch
    import transformers

    name = torch.cuda.get_device_name() if device == "cuda" else platform.machine()
    return CheckpointWritten(recipe=RECIPE, device=device, device_name=name, dtype=dtype,
                             torch=torch.__version__, cuda=torch.version.cuda or "",
                             transformers=transformers.__version__, safetensors=safetensors.__version__,
                             numpy=numpy.__version__)


def mismatch(recorded: CheckpointWritten | None, found: CheckpointInfo) -> str:
    """Why a checkpoint's sha256 differs from the one a run recorded, as far as the two records tell."""
    if recorded is None or found.written is None:
        return (f"how the run's checkpoint was written is not recorded; here: "
                f"{found.written.describe() if found.written else 'not recorded either'}" if recorded is None else
                "how this host's checkpoint was written is not recorded (a cached one from before it was: "
                f"remove {found.path} to write it again)")
    differ = recorded.differences(found.written)
    if differ:
        return "written differently: " + ", ".join(differ)
    return (f"written the same way as far as recorded ({found.written.describe()}): the cause is not among "
            "device, dtype and library versions (the GPU driver, or a nondeterministic initialisation kernel)")


def weights_sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(Path(folder).glob("*.safetensors")):
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def real_checkpoint(folder: Path) -> CheckpointInfo:
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelError(f"model folder {folder} has no config.json")
    return CheckpointInfo(path=folder, sha256=weights_sha256(folder))


def prepare_model(task) -> CheckpointInfo:
    """The checkpoint of a task's `model` section (agent.world.task.ModelSpec): the real weights it
    names, or its synthetic model, written once."""
    model = task.model
    if model.path:
        return real_checkpoint(model.path)
    synthetic = model.synthetic
    return ensure_synthetic(synthetic.config, synthetic.seed, synthetic.logit_scale, model.dtype,
                            final_norm_scale=synthetic.final_norm_scale, post_norm_scale=synthetic.post_norm_scale,
                            embedding_norm_sigma=synthetic.embedding_norm_sigma, qk_norm_scale=synthetic.qk_norm_scale)


def ensure_synthetic(config_path: Path, seed: int, logit_scale: float = 1.0, dtype: str = "bfloat16",
                     cache: Path | None = None, final_norm_scale: float = 1.0,
                     post_norm_scale: float = 1.0, embedding_norm_sigma: float = 0.0,
                     qk_norm_scale: float = 1.0) -> CheckpointInfo:
    """Write the checkpoint once per (config, seed, knobs); later calls return the cached one."""
    try:
        config = json.loads(Path(config_path).read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the synthetic model config {config_path}: {exc}") from None
    knobs = {"logit_scale": logit_scale, "final_norm_scale": final_norm_scale, "post_norm_scale": post_norm_scale,
             "embedding_norm_sigma": embedding_norm_sigma, "qk_norm_scale": qk_norm_scale}
    device = init_device()
    key = hashlib.sha256(json.dumps(
        {"config": config, "seed": seed, "dtype": dtype, "recipe": RECIPE,
         **({"init_device": device} if device != "cpu" else {}),
         **{k: v for k, v in knobs.items() if v != KNOB_DEFAULTS[k] or k == "logit_scale"}},
        sort_keys=True).encode()).hexdigest()[:16]
    folder = (cache or cache_root() / "models") / f"synthetic-{key}"
    manifest = folder / MANIFEST
    if manifest.is_file():
        return CheckpointInfo.model_validate_json(manifest.read_text()).model_copy(update={"cached": True})
    written = writing_environment(device, dtype)
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    started = time.time()
    params, margins = write_synthetic(config, staging, seed, knobs, dtype, device)
    sha256 = weights_sha256(staging)
    info = CheckpointInfo(path=folder, sha256=sha256, params=params, seed=seed, knobs=knobs,
                          init_device=device, margins=margins, seconds=round(time.time() - started, 2),
                          written=written.model_copy(update={"sha256": sha256, "seed": seed}))
    (staging / MANIFEST).write_text(info.model_dump_json(indent=2))
    for file in staging.iterdir():
        file.chmod(0o644)  # sandboxed servers run as another user and only read
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return info


def init_device() -> str:
    """A GPU when there is one: HF initialisation of billions of parameters is far slower on a CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")
QK_NORMS = ("q_norm", "k_norm")


def write_synthetic(config: dict, out: Path, seed: int, knobs: dict[str, float], dtype: str, device: str = "cpu"):
    """HF initialisation under the seed, then the knobs: `logit_scale` multiplies the tied
    embedding, `embedding_norm_sigma` gives its rows log-normal norms (row i times
    exp(sigma * z_i - sigma^2), z from seed + 1), `final_norm_scale` multiplies the final RMSNorm
    weight (all pre-softcap logits), and `post_norm_scale` every sub-layer post-norm weight
    (sub-layers outweigh the input token, which keeps free-running greedy output from repeating one
    token when margins are raised), and `qk_norm_scale` the q_norm and k_norm weights, which sets the
    attention temperature: Gemma 4 scores attention with scale 1.0 on RMS-normalised queries and keys,
    so with HF's init (norm weights of ones) the scores of a 256-wide head have a standard deviation of
    16 and every softmax is an argmax. Such a network is chaotic: a rounding difference between two
    correct kernels flips which key wins and the next token with it. On E2B with the post-norm point
    below, bf16 eager and SDPA attention in HF agree on 30% of top-1 tokens (median deficit 3.3 nats);
    qk_norm_scale 0.25 (scores' SD 1) brings that to near-ties only (benchmarks/results/h200-token-audit.md).
    On Gemma 4 E2B (H200, transformers 5.14.1), sigma 0.5, final
    norm 2 and post-norm 16 gave teacher-forced margins of median 1.25 nats with 19.4 unique tokens
    per 32 of free-running greedy output (benchmarks/results/h200-gemma4-e2b.md)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    hf_config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.mul_(knobs["logit_scale"])
        sigma = knobs.get("embedding_norm_sigma", 0.0)
        if sigma:
            z = torch.randn(embedding.shape[0], generator=torch.Generator().manual_seed(seed + 1))
            factors = torch.exp(sigma * z - sigma * sigma).to(embedding.device)
            embedding.copy_((embedding.float() * factors[:, None]).to(embedding.dtype))
        model.get_decoder().norm.weight.mul_(knobs["final_norm_scale"])
        for name, module in model.named_modules():
            leaf, weight = name.rsplit(".", 1)[-1], getattr(module, "weight", None)
            if leaf in POST_NORMS and weight is not None:
                weight.mul_(knobs["post_norm_scale"])
            if leaf in QK_NORMS and weight is not None:
                weight.mul_(knobs.get("qk_norm_scale", 1.0))
    margins = measure_margins(model, config["vocab_size"], seed)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    add_shared_kv_tensors(out)
    write_synthetic_tokenizer(out, config["vocab_size"])
    return params, margins


def measure_margins(model, vocab_size: int, seed: int, prompts: int = 4, length: int = 64) -> Margins:
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(4, vocab_size, (prompts, length), generator=generator)
    with torch.no_grad():
        logits = model(input_ids=ids.to(model.device)).logits.float()
    top = torch.log_softmax(logits, dim=-1).topk(2, dim=-1).values
    return Margins.of((top[..., 0] - top[..., 1]).flatten().cpu().numpy())


def add_shared_kv_tensors(folder: Path) -> int:
    """vLLM's loader expects K/V projections and k_norm on KV-shared layers; transformers omits them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.loads((folder / "config.json").read_text())
    layers, shared = cfg["num_hidden_layers"], cfg.get("num_kv_shared_layers") or 0
    if not shared:
        return 0
    types, first = cfg["layer_types"], layers - shared
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    if index:
        where = index["weight_map"]
    else:
        with safe_open(folder / "model.safetensors", "pt") as f:
            where = {k: "model.safetensors" for k in f.keys()}
    extra = {}
    for i in range(first, layers):
        source = max(j for j in range(first) if types[j] == types[i])
        for weight in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            name = f"model.layers.{i}.self_attn.{weight}"
            source_name = f"model.layers.{source}.self_attn.{weight}"
            if name in where or source_name not in where:
                continue
            with safe_open(folder / where[source_name], "pt") as f:
                extra[name] = f.get_tensor(source_name).clone()
    if extra:
        save_file(extra, folder / SHARED_KV_SHARD, metadata={"format": "pt"})
        if index:
            index["weight_map"].update({k: SHARED_KV_SHARD for k in extra})
            index_path.write_text(json.dumps(index, indent=2))
    return len(extra)


def write_synthetic_tokenizer(folder: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer where word `t<id>` is token <id>: enough for token-id prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {SPECIAL_TOKENS.get(i, f"t{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)])
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS.values()))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 131072,
        "clean_up_tokenization_spaces": False}, indent=2))
