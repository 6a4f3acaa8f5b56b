from sandbox.base import Outcome, Sandbox, SandboxError, Server, ServerSpec
from sandbox.config import SandboxConfig


def make_sandbox(config: SandboxConfig, run_dir) -> Sandbox:
    """The backend a task's `sandbox` section asks for."""
    if config.backend == "docker":
        from sandbox.docker_backend import DockerSandbox

        return DockerSandbox(config, run_dir)
    if config.backend == "namespace":
        from sandbox.namespace import NamespaceSandbox

        return NamespaceSandbox(config, run_dir)
    from sandbox.local import LocalSandbox

    return LocalSandbox(config, run_dir)


__all__ = ["Outcome", "Sandbox", "SandboxConfig", "SandboxError", "Server", "ServerSpec", "make_sandbox"]
