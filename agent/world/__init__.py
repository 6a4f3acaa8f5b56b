"""The task and what it runs on: task files, the vLLM checkout, checkpoints, serving arguments, caches."""
