"""Server start times of runs: the harness's own clock (server_starts.jsonl) and what vLLM logged
(graphs compiled, compile and engine-init seconds), a row per server.

    python3 benchmarks/server_starts.py RUN_DIR [RUN_DIR ...] [--json OUT]
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

COMPILED = re.compile(r"Compiling a graph for compile range \(.*?\) takes ([\d.]+) s")
INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s(?: \(compilation: ([\d.]+) s\))?")
CACHE_HIT = re.compile(r"Directly load the compiled graph|Loading compiled graph|from the cache", re.I)


def server_log(run: Path, name: str) -> str:
    for path in (run / "servers" / name / "server.log", run / "servers" / f"{name}.log"):
        if path.exists():
            return path.read_text(errors="replace")
    return ""


def rows(run: Path) -> list[dict]:
    found = []
    starts = run / "server_starts.jsonl"
    for line in starts.read_text().splitlines() if starts.exists() else []:
        start = json.loads(line)
        text = server_log(run, start["server"])
        init = INIT.search(text)
        found.append(start | {
            "run": run.name,
            "graphs_compiled": len(COMPILED.findall(text)),
            "graph_compile_s": round(sum(float(s) for s in COMPILED.findall(text)), 2),
            "cache_hits": len(CACHE_HIT.findall(text)),
            "engine_init_s": float(init.group(1)) if init else None,
            "compilation_s": float(init.group(2)) if init and init.group(2) else None,
        })
    return found


def main(argv: list[str]) -> None:
    out = None
    if "--json" in argv:
        out = Path(argv[argv.index("--json") + 1])
        argv = [a for i, a in enumerate(argv) if a != "--json" and (i == 0 or argv[i - 1] != "--json")]
    table = [r for run in argv for r in rows(Path(run))]
    print("| run | server | backend | outcome | start s | graphs compiled | compile s | engine init s | cache hits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['run']} | {r['server']} | {r['backend']} | {r['outcome']} | {r['seconds']:.1f} | {r['graphs_compiled']} "
              f"| {r['graph_compile_s']:.1f} | {r['engine_init_s'] or '-'} | {r['cache_hits']} |")
    if out:
        out.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
