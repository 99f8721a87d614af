# One image for every Tollgate process (gateway, engine replicas, Celery worker and beat, migrations);
# docker-compose.yml picks the command. Torch comes from PyPI (CUDA wheels on x86-64 Linux); for a
# CPU-only image build with: --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
FROM python:3.11-slim

ARG PIP_EXTRA_INDEX_URL=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}

RUN useradd --create-home --uid 10001 --user-group tollgate \
    && mkdir -p /models /var/lib/tollgate/files /var/lib/tollgate/beat \
    && chown -R tollgate:tollgate /models /var/lib/tollgate

WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY tollgate ./tollgate
COPY gateway ./gateway
COPY billing ./billing
COPY engine ./engine
COPY kernels ./kernels
COPY admin_ui ./admin_ui
COPY migrations ./migrations
RUN pip install .

USER tollgate
EXPOSE 8000 8100
CMD ["tollgate", "gateway", "--host", "0.0.0.0", "--port", "8000"]
