# duet-serve CPU image: the README's install steps, the per-role launch scripts as entrypoints.
#
#   docker build -t duet-serve:0.1.0 .
#   docker run duet-serve:0.1.0 CONFIG                       # the router (the default entrypoint)
#   docker run --entrypoint /opt/duet-serve/deploy/launch_prefill.sh duet-serve:0.1.0 CONFIG NODE
#   docker run --entrypoint /opt/duet-serve/deploy/launch_decode.sh  duet-serve:0.1.0 CONFIG NODE
#
# The Kubernetes manifests (deploy/k8s, `duet k8s render`) run the same scripts as the pods'
# command and mount the cluster TOML at /etc/duet/config/cluster.toml. Not built in this
# repository's CI (no container daemon there): see the README's Kubernetes section.
FROM python:3.11.7-slim-bookworm

# A C++ compiler (with OpenMP) for the native kernels, built by `pip install -e .`.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/duet-serve
COPY . .

# As the README: torch pinned first (the CPU wheel; a bare `torch` would pull a CUDA build),
# then the project.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install --no-cache-dir -e ".[k8s]"

# The built-in tiny model (the configs' `model = ""`), made once at build time so that no pod
# writes it at start; a real checkpoint is mounted at the TOML's `model` path instead.
ENV DUET_CACHE_DIR=/opt/duet-serve/cache \
    PYTHONUNBUFFERED=1
# (The cache is written through a private temporary folder: make it readable to the user.)
RUN python -m tinymodel \
    && chmod -R a+rX "$DUET_CACHE_DIR"

# The user the manifests run as (runAsUser / fsGroup 10001).
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin duet
USER 10001

ENTRYPOINT ["/opt/duet-serve/deploy/launch_router.sh"]
CMD ["/etc/duet/config/cluster.toml"]
