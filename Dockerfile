# CPU image of the server with the bundled models. Build: docker build -t tserve .
# Run:   docker run -p 8000:8000 tserve      (settings: -e TSERVE_...)
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TSERVE_HOST=0.0.0.0 \
    TSERVE_PORT=8000 \
    TSERVE_MODELS_DIR=/app/models

WORKDIR /app
# The CPU build of torch first, so that installing tserve does not pull a CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml README.md ./
COPY model ./model
COPY service ./service
RUN pip install . && useradd --create-home --uid 10001 tserve
COPY models ./models

USER tserve
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
CMD ["tserve", "serve"]
