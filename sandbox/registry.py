"""Registries of named kinds (agent/extensions.py lists every extension point), and the sandbox backends'.

A kind is registered by the file that defines it: `BACKENDS.register(Backend("slurm", "sandbox.slurm:SlurmSandbox"))`
at the end of sandbox/slurm.py makes `sandbox: {backend: slurm}` a valid task setting, `make_sandbox` start its
servers and a run's checks probe it. A name not registered yet has the registry import its package's modules once
(so a new file is found without being listed anywhere), then it is refused with the names known."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

E = TypeVar("E")


def resolve(ref):
    """`module:attr.attr` imported, or the object itself."""
    if not isinstance(ref, str):
        return ref
    module, _, path = ref.partition(":")
    value = importlib.import_module(module)
    for name in path.split("."):
        value = getattr(value, name)
    return value


class Registry(Generic[E]):
    def __init__(self, what: str, package: str):
        self.what, self.package = what, package
        self.entries: dict[str, E] = {}
        self.scanned = False

    def register(self, name: str, entry: E) -> E:
        self.entries[name] = entry
        return entry

    def scan(self) -> None:
        """Import every module of the package once, so that each file's registrations run."""
        if self.scanned:
            return
        self.scanned = True
        package = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(package.__path__, f"{self.package}."):
            try:
                importlib.import_module(info.name)
            except Exception:  # a module whose dependencies are not installed registers nothing
                continue

    def get(self, name: str) -> E:
        if name not in self.entries:
            self.scan()
        if name not in self.entries:
            raise ValueError(f"unknown {self.what} {name!r}; registered: {', '.join(self.names())}")
        return self.entries[name]

    def names(self) -> list[str]:
        return sorted(self.entries)


@dataclass(frozen=True)
class Backend:
    """A sandbox backend: `sandbox` (or "module:Class") is called as sandbox(config, run_dir) and has
    `probe(config)`, which raises where this host cannot run it (no Docker engine, no user namespaces)."""
    name: str
    sandbox: Callable | str

    def load(self):
        return resolve(self.sandbox)

    def probe(self, config) -> None:
        self.load().probe(config)


BACKENDS: Registry[Backend] = Registry("sandbox backend", "sandbox")
for _backend in (Backend("local", "sandbox.local:LocalSandbox"), Backend("docker", "sandbox.docker_backend:DockerSandbox"),
                 Backend("namespace", "sandbox.namespace:NamespaceSandbox")):
    BACKENDS.register(_backend.name, _backend)


def register_backend(name: str, sandbox: Callable | str) -> Backend:
    return BACKENDS.register(name, Backend(name, sandbox))
