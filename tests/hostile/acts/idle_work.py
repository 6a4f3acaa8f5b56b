"""Leaves work running where a freeze of its server might not reach: a busy loop in a grandchild that has left the
server's session and process group (setsid and a double fork), as a candidate would that slows the incumbent's
passes while its own server sits idle."""
import os

from vllm.entrypoints.cli.stub_server import serve

if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            pass
    os._exit(0)
os.wait()
serve({"act": "idle_work"})
