"""Warm starts from a seeded compile cache: the local backend against the namespace backend.

    python3 benchmarks/warm_start.py [--out results.json]

Two worktrees of the same vLLM checkout (as two candidates of a run are); for each backend, the
first tree's server starts cold and exports its caches, then the second tree's server starts from
that seed. Prints, per start, the time to healthy and the compile lines of its log (torch.compile on
vLLM's CPU build, with a C++ compiler on the host)."""
from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

COMPILED = re.compile(r"saved AOT compiled function|Compiling model again|Compiling a graph|torch\.compile takes")
LOADED = re.compile(r"Directly load")
FAILED_LOAD = re.compile(r"load failure from")
ENGINE_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")
ENGINE_ARGS = {"dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 4}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def worktrees(work: Path) -> tuple[Path, Path, Path]:
    import git

    from agent.stages.build import build
    from agent.world.checkout import create_checkout

    checkout, _ = create_checkout(work / "checkout")
    trees = []
    for name in ("tree-a", "tree-b"):
        tree = work / "worktrees" / name
        git.Repo(checkout).git.worktree("add", "--detach", str(tree), "HEAD")
        build(0, tree, [])
        trees.append(tree)
    return checkout, trees[0], trees[1]


def one_start(sandbox, name: str, tree: Path, model: Path, seed: Path | None, export_to: Path | None) -> dict:
    from sandbox.base import ServerSpec

    spec = ServerSpec(name=name, source_tree=tree, model_dir=model, engine_args=ENGINE_ARGS, env=ENV,
                      startup_timeout_s=900, cache_seed=seed)
    started = time.monotonic()
    server = sandbox.start(spec)
    healthy_s = time.monotonic() - started
    if export_to is not None:
        sandbox.export_cache(server, export_to)
    server.stop()
    logs = server.logs(limit=5_000_000)
    return {"server": name, "healthy_s": round(healthy_s, 1),
            "compile_lines": sum(1 for line in logs.splitlines() if COMPILED.search(line)),
            "cache_load_lines": sum(1 for line in logs.splitlines() if LOADED.search(line)),
            "failed_load_lines": sum(1 for line in logs.splitlines() if FAILED_LOAD.search(line)),
            "engine_init_s": next((float(m.group(1)) for m in ENGINE_INIT.finditer(logs)), None),
            "compile_log": [line.strip()[-160:] for line in logs.splitlines() if COMPILED.search(line) or LOADED.search(line)]}


def measure(work: Path) -> list[dict]:
    from agent.world.checkpoint import ensure_synthetic
    from sandbox.config import SandboxConfig
    from sandbox.local import LocalSandbox
    from sandbox.namespace import NamespaceSandbox

    root = Path(__file__).resolve().parents[1]
    model = ensure_synthetic(root / "tasks" / "models" / "gemma4-tiny" / "config.json", seed=0, dtype="bfloat16").path
    _, tree_a, tree_b = worktrees(work)
    rows = []
    backends = {"local": LocalSandbox(None, work / "run-local"),
                "namespace": NamespaceSandbox(SandboxConfig(backend="namespace", memory_gb=8, tmpfs_mb=4096),
                                              work / "run-namespace")}
    for backend, sandbox in backends.items():
        seed = work / f"seed-{backend}"
        for row in (one_start(sandbox, f"{backend}-cold", tree_a, model, None, seed),
                    one_start(sandbox, f"{backend}-warm", tree_b, model, seed, None)):
            rows.append({"backend": backend, **row})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="warm-start-") as work:
        rows = measure(Path(work))
    print("| backend | start | healthy after | engine init | compile lines | cache loads | failed loads |\n"
          "|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['backend']} | {row['server'].split('-')[-1]} | {row['healthy_s']} s | {row['engine_init_s']} s | "
              f"{row['compile_lines']} | {row['cache_load_lines']} | {row['failed_load_lines']} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
