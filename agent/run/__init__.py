"""A run's orchestration: setup, the loop, the Judge, the Incumbent, servers, worktrees, resume, workers."""
