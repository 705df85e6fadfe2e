# The project image: `modelserver` (sim and torch backends), `epp` and the conformance tools.
# Runs as a non-root user and needs no writable root filesystem (mount /tmp as an emptyDir).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY modelserver ./modelserver
COPY epp ./epp
COPY manifests/envoy ./manifests/envoy
RUN pip install --no-cache-dir '.[torch]' && useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin app
USER 65532
EXPOSE 8000 9002 9003 9090
CMD ["epp", "--help"]
