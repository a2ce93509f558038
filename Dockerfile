# Sluice gateway and replica emulator image, with the runtime dependencies only (no test, lint or
# benchmark tools: those are the `dev` and `bench` extras of pyproject.toml).
# Build: docker build -t sluice .
# Run with your configuration (server.host: 0.0.0.0):
#   docker run -p 8080:8080 -v "$PWD/sluice.yaml:/etc/sluice/sluice.yaml:ro" sluice serve --config /etc/sluice/sluice.yaml
# Or in front of running replicas, configured from the environment (docs/cli.md):
#   docker run -p 8080:8080 -e SLUICE_REPLICAS=http://10.0.0.5:8000 -e SLUICE_LISTEN=0.0.0.0:8080
#     -e SLUICE_DEMO_TENANT=1 sluice        (one command line)
# The HEALTHCHECK probes http://127.0.0.1:8080/healthz; a gateway listening on another port, or
# an emulator (`sluice sim`, /health), sets SLUICE_HEALTHCHECK_URL.
ARG PYTHON_IMAGE=python:3.11-slim

# -- build: Sluice and its runtime dependencies into a virtual environment --------------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# What the wheel holds (tool.setuptools.packages.find) and the metadata it is built from.
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY predictor ./predictor
COPY simulator ./simulator
COPY replay ./replay
COPY planner ./planner
RUN python -m venv /opt/sluice \
    && /opt/sluice/bin/pip install --no-cache-dir . \
    && /opt/sluice/bin/pip uninstall --yes pip setuptools

# -- runtime: the virtual environment alone, run by an unprivileged user ----------------------------
# The same base as the build stage: the environment's python links to this image's interpreter.
FROM ${PYTHON_IMAGE}
ENV PATH=/opt/sluice/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_HEALTHCHECK_URL=http://127.0.0.1:8080/healthz
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin sluice
COPY --from=build /opt/sluice /opt/sluice
USER sluice
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['SLUICE_HEALTHCHECK_URL'], timeout=2)"]
ENTRYPOINT ["sluice"]
CMD ["serve"]
