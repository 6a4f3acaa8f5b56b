"""A busy neighbour that switches on and off at random: one process spinning on the CPU for a random stretch, then
idle for another, until it is stopped. Run it beside `nightshift noise` to see the judge beside a load it cannot
predict (issue: the judge's spread quiet, beside a neighbour, beside a test suite).

    python3 benchmarks/noise/neighbour.py --seed 0 --on 0.5 5 --off 0.5 5 &
    nightshift noise ...; kill %1        # on SIGTERM it prints how long it was busy

The stretches are drawn uniformly from the given ranges (seconds) with a seeded generator, so a study can be
repeated with the same pattern; where it lands relative to the benchmark's passes is not controlled."""
from __future__ import annotations

import argparse
import random
import signal
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--on", type=float, nargs=2, default=(0.5, 5.0), metavar=("MIN", "MAX"),
                        help="seconds busy, drawn uniformly")
    parser.add_argument("--off", type=float, nargs=2, default=(0.5, 5.0), metavar=("MIN", "MAX"),
                        help="seconds idle, drawn uniformly")
    args = parser.parse_args()
    for lo, hi in (args.on, args.off):
        if not 0 <= lo <= hi:
            parser.error(f"a range must be 0 <= MIN <= MAX, got {lo} {hi}")
    rng = random.Random(args.seed)
    began, busy = time.monotonic(), 0.0
    stop = False

    def finish(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    while not stop:
        until = time.monotonic() + rng.uniform(*args.on)
        start = time.monotonic()
        while not stop and time.monotonic() < until:
            sum(i * i for i in range(2000))
        busy += time.monotonic() - start
        if not stop:
            time.sleep(rng.uniform(*args.off))
    whole = time.monotonic() - began
    print(f"neighbour: busy {busy:.0f} s of {whole:.0f} s ({busy / max(whole, 1e-9):.0%})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
