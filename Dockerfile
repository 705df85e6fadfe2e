# Three images from one build, each with only its part installed (non-root uid 65532, no writable root filesystem
# needed: mount /tmp as an emptyDir):
#   docker build --target epp               -t ghcr.io/llm-routing-reference/epp:0.1.0 .
#   docker build --target modelserver-sim   -t ghcr.io/llm-routing-reference/modelserver-sim:0.1.0 .
#   docker build --target modelserver-torch -t ghcr.io/llm-routing-reference/modelserver-torch:0.1.0 .
# The wheel: the release build (setup.py, EPP_RELEASE=1): the runtime packages and their console scripts only (no
# harness), the EPP's request path compiled with Cython, profile-guided: setup.py trains it on the workshop's
# handler-cpu bench, which this stage alone holds, with the runtime's dependencies installed here (Cython among them).
# The compiler stays in this stage: the images get only the wheel.
FROM python:3.11-slim AS wheel
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 EPP_RELEASE=1
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protocol ./protocol
COPY modelserver ./modelserver
COPY epp ./epp
COPY harness ./harness
RUN EPP_RELEASE=0 pip install ".[epp]" && rm -rf build *.egg-info && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

FROM python:3.11-slim AS source
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
COPY --from=wheel /wheels /wheels
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin app

# The Endpoint Picker: the core and [epp] (gRPC, Kubernetes client, HTTP/2); no tokenizer, no torch, no Envoy.
FROM source AS epp
RUN pip install "$(ls /wheels/*.whl)[epp]" && rm -rf /wheels
USER 65532
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp"]

# The sim model server: the core and [modelserver] (tokenizer, chat templates); no gRPC, no torch.
FROM source AS modelserver-sim
RUN pip install "$(ls /wheels/*.whl)[modelserver]" && rm -rf /wheels
USER 65532
EXPOSE 8000
ENTRYPOINT ["modelserver"]

# The torch model server: [torch] (torch, safetensors and the model server's part).
FROM source AS modelserver-torch
RUN pip install "$(ls /wheels/*.whl)[torch]" && rm -rf /wheels
USER 65532
EXPOSE 8000
ENTRYPOINT ["modelserver"]
