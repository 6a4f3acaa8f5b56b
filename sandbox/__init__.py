from sandbox.base import Outcome, Sandbox, SandboxError, Server, ServerSpec
from sandbox.config import SandboxConfig
from sandbox.registry import BACKENDS, Backend, register_backend


def make_sandbox(config: SandboxConfig, run_dir) -> Sandbox:
    """The backend a task's `sandbox` section asks for (sandbox/registry.py)."""
    return BACKENDS.get(config.backend).load()(config, run_dir)


__all__ = ["Outcome", "Sandbox", "SandboxConfig", "SandboxError", "Server", "ServerSpec", "make_sandbox", "BACKENDS", "Backend", "register_backend"]
