"""Allocates (and touches) memory until something stops it; never serves."""
import time

hoard = []
while True:
    hoard.append(b"\x01" * (64 << 20))
    print(f"memory_hog: {len(hoard) * 64} MiB", flush=True)
    time.sleep(0.01)
