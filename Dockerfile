# The image that evaluates nightshift candidates (see docs/sandbox.md).
#
# BASE_IMAGE must hold the target vLLM with its compiled parts at the same absolute path as on
# the harness's host, because candidate trees link those parts by absolute path (agent/stages/build.py):
#   CPU: nightshift-base:cpu, built locally by scripts/docker-base.sh (this machine's Python, same prefix)
#   GPU: vllm/vllm-openai:v<version>, with HOST_SITE_PACKAGES set to the host's site-packages
#        folder that holds vllm/ when it differs from the image's (a link is made there).
# Nothing is copied in: the harness mounts the candidate tree, the model and the import recorder
# read-only at run time, and a Unix-socket folder read-write.
ARG BASE_IMAGE=nightshift-base:cpu
FROM ${BASE_IMAGE}

ARG SANDBOX_UID=10001
ARG HOST_SITE_PACKAGES=

USER root
RUN set -eu; \
    if ! getent passwd "${SANDBOX_UID}" >/dev/null; then \
      useradd --uid "${SANDBOX_UID}" --user-group --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin nightshift; \
    fi; \
    mkdir -p /sandbox/tree /sandbox/model /sandbox/recorder /sandbox/io; \
    chmod 755 /root; \
    site=$(python3 -c 'import os, vllm; print(os.path.dirname(os.path.dirname(os.path.realpath(vllm.__file__))))'); \
    if [ -n "${HOST_SITE_PACKAGES}" ] && [ "${HOST_SITE_PACKAGES}" != "${site}" ]; then \
      if [ -e "${HOST_SITE_PACKAGES}" ]; then echo "${HOST_SITE_PACKAGES} exists in the image" >&2; exit 1; fi; \
      mkdir -p "$(dirname "${HOST_SITE_PACKAGES}")"; \
      ln -s "${site}" "${HOST_SITE_PACKAGES}"; \
    fi; \
    python3 -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'

ENV HOME=/tmp TMPDIR=/tmp XDG_CACHE_HOME=/tmp/.cache PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
USER ${SANDBOX_UID}
WORKDIR /tmp
ENTRYPOINT []
CMD ["python3", "-m", "vllm.entrypoints.cli.main", "--help"]
LABEL nightshift.image="sandbox"
