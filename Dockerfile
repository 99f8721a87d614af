# One image for every Tollgate process (gateway, engine replicas, Celery worker and beat, migrations);
# docker-compose.yml picks the command. Torch and Triton are pinned by constraints/cuda.txt (PyPI's CUDA
# build for x86-64 Linux). A CPU-only image: --build-arg TORCH_CONSTRAINTS=constraints/cpu.txt
# --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# tests/tollgate/test_image.py replays these steps without a Docker engine.
FROM python:3.11-slim

# A C compiler and libc headers: Triton builds its CUDA driver stub (and its kernel launchers) with
# one at the first kernel launch, and the engine its fused CPU kernels. python:3.11-slim has neither.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ARG PIP_EXTRA_INDEX_URL=
ARG TORCH_CONSTRAINTS=constraints/cuda.txt
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}

RUN useradd --create-home --uid 10001 --user-group tollgate \
    && mkdir -p /models /var/lib/tollgate/files /var/lib/tollgate/beat /var/lib/tollgate/kv \
    && chown -R tollgate:tollgate /models /var/lib/tollgate

WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY constraints ./constraints
COPY tollgate ./tollgate
COPY gateway ./gateway
COPY billing ./billing
COPY engine ./engine
COPY kernels ./kernels
COPY admin_ui ./admin_ui
COPY migrations ./migrations
RUN pip install -c ${TORCH_CONSTRAINTS} .

USER tollgate
EXPOSE 8000 8100
CMD ["tollgate", "gateway", "--host", "0.0.0.0", "--port", "8000"]
