# imgedit: Qwen image-edit models behind Gradio + FastAPI, on NVIDIA GPUs.
#   docker build -t imgedit:latest .
#   docker run --gpus all -p 7860:7860 -v models:/models --env-file .env imgedit:latest
# The torch wheel from PyPI brings its own CUDA libraries; the host only needs a recent NVIDIA driver
# and the NVIDIA Container Toolkit.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu's archive does not keep old package versions, so exact apt pins would break rebuilds;
# the base image tag is pinned instead.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /app

# Dependencies first so that code changes do not reinstall torch (several GB).
# requirements.txt pins torch==2.13.0; on Linux x86-64 PyPI serves the CUDA build.
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt

# Ubuntu 24.04 images ship a user `ubuntu` with uid 1000; replace it with our own.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin imgedit \
    && mkdir -p /models/hf \
    && chown -R imgedit:imgedit /models

# Code stays root-owned (read-only for the app user).
COPY app.py ./
COPY imgedit/ ./imgedit/

# The compiler's cache and the checkpoint's measured sizes (and checked LoRA files) on the model volume: a
# recreated container (compose down/up, a new image) plans and compiles from them instead of again.
ENV HF_HOME=/models/hf \
    COMPILE_CACHE_DIR=/models/compile \
    IMGEDIT_SIZES_CACHE=/models/imgedit-sizes \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    CUDA_DEVICE_ORDER=PCI_BUS_ID

VOLUME ["/models"]
# Numeric, so that Kubernetes runAsNonRoot can verify it.
USER 1000:1000
EXPOSE 7860

# /health answers 503 while the model loads (minutes on first start: the download is tens of GB).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('GRADIO_SERVER_PORT', '7860') + '/health', timeout=8)"]

CMD ["python", "app.py"]
