"""Tries to reach the outside: a TCP connection to public addresses and a DNS lookup."""
import socket

from vllm.entrypoints.cli.stub_server import serve

observed = {"act": "network", "tcp": {}, "dns": {}}
for host, port in [("1.1.1.1", 443), ("8.8.8.8", 53), ("151.101.0.223", 443)]:
    try:
        socket.create_connection((host, port), timeout=3).close()
        observed["tcp"][f"{host}:{port}"] = "connected"
    except OSError as exc:
        observed["tcp"][f"{host}:{port}"] = f"{type(exc).__name__}: {exc}"
for name in ["pypi.org", "huggingface.co"]:
    try:
        observed["dns"][name] = "resolved " + socket.getaddrinfo(name, 443)[0][4][0]
    except OSError as exc:
        observed["dns"][name] = f"{type(exc).__name__}: {exc}"
observed["interfaces"] = [name for _, name in socket.if_nameindex()]
serve(observed)
