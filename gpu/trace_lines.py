"""One line per trace record of a run folder, for following a run from a terminal."""
import json
import sys
import time
from pathlib import Path

KEYS = ("candidate", "verdict", "stage", "ok", "prompts", "regime", "speedup", "ci_low", "ci_high", "summary",
        "reason", "engine_args", "seconds", "kept")

for line in (Path(sys.argv[1]) / "trace.jsonl").read_text().splitlines():
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        print("(torn line)")
        continue
    event = record.get("event", record)
    when = time.strftime("%H:%M:%S", time.gmtime(event.get("time", record.get("time", 0)) or 0))
    fields = {k: event[k] for k in KEYS if event.get(k) not in (None, "", [], {})}
    if event.get("kind") == "benchmark":
        fields["samples"] = [(s["role"][0], round(s[event.get("metric", "total_tokens_per_s")])) for s in event["samples"]]
    if event.get("kind") == "sample":
        s = event["sample"]
        fields["pass"] = f"{s['role']} rep {s['repetition']}: {s['total_tokens_per_s']:.0f} tok/s in {s['seconds']:.1f}s"
    text = json.dumps(fields, default=str)
    print(f"{when} {event.get('kind', '?'):<14} {text[:400]}")
