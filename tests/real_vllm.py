"""How the tests that serve real vLLM start their servers.

ONE_PROCESS: the engine core runs the model itself (vLLM's `uni` executor) instead of in a worker process of its
own, one process and one import of vLLM less a server: a start of the tiny CPU task took 26.1 s against 35.7 s on a
quiet 2-core host, and the suite starts some twenty. The task files keep vLLM's default; these tests exercise the
loop, the sandboxes and the audit, not the executor.
"""
ONE_PROCESS = {"distributed_executor_backend": "uni"}
ONE_PROCESS_SETTINGS = [f"engine.args.{key}={value}" for key, value in ONE_PROCESS.items()]
"""ONE_PROCESS as `--set` settings (agent.world.task.with_settings)."""
ONE_PROCESS_FLAGS = [flag for setting in ONE_PROCESS_SETTINGS for flag in ("--set", setting)]
"""ONE_PROCESS as the CLI's `--set` flags."""
