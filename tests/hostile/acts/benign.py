"""Does nothing hostile: the control candidate that must run normally after each hostile one."""
from vllm.entrypoints.cli.stub_server import serve

serve({"act": "benign", "uid": __import__("os").getuid()})
