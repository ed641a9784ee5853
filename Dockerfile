# The sidecar's image: the package from this repository on a slim Python, run as a non-root user.
# Build from the repository root: docker build -t lora-sidecar . (compose/ does it for you).

# Pinned by tag and by the digest of its multi-architecture index, so a rebuild starts from the
# same bytes; bump both together.
FROM python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Build in a throw-away stage: the source tree and pip's build environment stay out of the image.
FROM base AS build
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN /opt/venv/bin/pip install --no-cache-dir .

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
