# The sidecar's image: the package from this repository on a slim Python, run as a non-root user.
# Build from the repository root (BuildKit, the default builder since Docker 23):
#     docker build -t lora-sidecar:local .
# compose/ builds it for you. Behind a TLS-inspecting proxy, hand pip the proxy's CA as a build
# secret; it is used by the build and never stored in the image:
#     DOCKER_BUILDKIT=1 docker build --secret id=ca,src=/path/to/ca-bundle.pem -t lora-sidecar:local .

# Pinned by tag and by the digest of its multi-architecture index, so a rebuild starts from the
# same bytes; bump both together. Any Debian bookworm with Python 3.11 (python3, python3-venv,
# groupadd/useradd) can stand in: --build-arg BASE_IMAGE=... (the tests build one with debootstrap).
ARG BASE_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Build in a throw-away stage: the source tree and pip's build environment stay out of the image.
# With the `signing` extra: the node's sidecar and minio-init's uploader can check signatures.
FROM base AS build
# python3, not python: Debian's own interpreter has no `python` command.
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
# The optional `ca` secret: a CA bundle for pip when registries are reached through a gateway
# that re-signs TLS. Without it pip uses its own certificates.
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && /opt/venv/bin/pip install --no-cache-dir '.[signing]'

FROM base
# A fixed uid/gid: a host folder used as the cache must be writable by it (see compose/README.md).
# The cache folder is created here, owned by that user, because an empty named volume mounted on
# it starts out with the folder's owner.
RUN groupadd --system --gid 10001 sidecar \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin sidecar \
    && install -d -o 10001 -g 10001 /var/lib/lora-sidecar /var/lib/lora-sidecar/cache
COPY --from=build /opt/venv /opt/venv
# Triton's model repository (the router and vllm_model's config), for --seed-model-repository:
# on Kubernetes the sidecar copies it onto the cache volume Triton loads from (deploy/k8s).
COPY triton_repo /opt/lora-sidecar/triton_repo
ENV PATH=/opt/venv/bin:$PATH \
    LORA_SIDECAR_CACHE_ROOT=/var/lib/lora-sidecar/cache
WORKDIR /var/lib/lora-sidecar
USER 10001:10001
EXPOSE 8500
ENTRYPOINT ["lora-sidecar"]
CMD ["serve"]
