from sandbox.base import Outcome, Sandbox, SandboxError, Server, ServerSpec


def make_sandbox(config, run_dir):
    """The backend a task's `sandbox` section asks for."""
    if config.backend == "docker":
        from sandbox.docker_backend import DockerSandbox

        return DockerSandbox(config, run_dir)
    from sandbox.local import LocalSandbox

    return LocalSandbox(config, run_dir)


__all__ = ["Outcome", "Sandbox", "SandboxError", "Server", "ServerSpec", "make_sandbox"]
