# Sluice gateway and replica emulator image.
# Build: docker build -t sluice .   Run: docker run -p 8080:8080 sluice serve --config /etc/sluice/sluice.yaml
# Or in front of running replicas, configured from the environment (docs/cli.md):
#   docker run -p 8080:8080 -e SLUICE_REPLICAS=http://10.0.0.5:8000 -e SLUICE_LISTEN=0.0.0.0:8080
#     -e SLUICE_DEMO_TENANT=1 sluice        (one command line)
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY predictor ./predictor
COPY simulator ./simulator
COPY config ./config
# Editable install: the emulator finds its profiles under /app/config/profiles.
RUN pip install --no-cache-dir -e . && useradd --system --uid 10001 sluice
USER sluice
EXPOSE 8080
ENTRYPOINT ["sluice"]
CMD ["serve"]
