"""Never answers, and ignores SIGTERM: only a kill ends it."""
import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("hang: ignoring SIGTERM, sleeping", flush=True)
while True:
    time.sleep(3600)
