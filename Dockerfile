# One image for both services: `python -m ps_service` (the default command) and `python -m worker_service`.
# Dependencies are installed from pyproject.toml alone, before the code is copied, so a code change
# rebuilds in seconds. Plain Dockerfile syntax: builds with BuildKit and with the legacy builder.
# Two stages: `deps` pip-installs the dependencies into a virtualenv, /opt/venv (without a pip of its
# own: the base image's pip installs into it), which the image copies, so wheels handed to the build
# (wheels/, below) never end up in the image.
FROM python:3.11-slim AS deps

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv --without-pip /opt/venv

ARG EXTRAS=mlp
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

WORKDIR /build
# wheels/*.whl, if any (`wheels*`: the build works without the directory; .dockerignore lets in nothing
# else of it): wheels pip may take instead of downloading them (--find-links), e.g. torch's CPU wheel
# where TORCH_INDEX_URL is out of reach; with a torch-*.whl there, that index is not asked at all.
# torch comes first and alone, from wheels/ or from TORCH_INDEX_URL only: where neither has it the build
# stops and says so, rather than take PyPI's CUDA build (a 5.4 GB image; measured when that index was out
# of reach). TORCH_INDEX_URL=https://pypi.org/simple takes that build on purpose.
COPY pyproject.toml wheels* ./
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = os.environ.get('EXTRAS', '').replace(',', ' ').split(); \
print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" \
      > requirements.txt \
 && case ",$EXTRAS," in *,torch,*) \
      if ls torch-*.whl >/dev/null 2>&1; then where=--no-index; else where="--index-url=$TORCH_INDEX_URL"; fi; \
      pip --python /opt/venv/bin/python install --no-deps --find-links . "$where" "$(grep '^torch' requirements.txt)" \
      || { echo "syncps: no torch CPU wheel in wheels/ nor at $TORCH_INDEX_URL: put the wheel in wheels/" \
                "(docs/torch.md, Image) or set TORCH_INDEX_URL" >&2; exit 1; } ;; \
    esac \
 && pip --python /opt/venv/bin/python install --find-links . -r requirements.txt

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

COPY --from=deps /opt/venv /opt/venv
# A non-root user; /data/checkpoints belongs to it, so a fresh named volume mounted there does too.
RUN useradd --create-home --uid 10001 --user-group syncps \
 && mkdir -p /data/checkpoints && chown -R syncps:syncps /data
WORKDIR /app
COPY shared/ shared/
COPY ps_service/ ps_service/
COPY worker_service/ worker_service/
COPY syncps/ syncps/
USER syncps

EXPOSE 8000
# Exec form: the service is PID 1 and receives SIGTERM itself. A worker that is PID 1 names itself
# after its container (syncps-worker-1, by reverse DNS on the compose network; else hostname:pid), so a
# restarted worker container keeps its name and its rank.
CMD ["python", "-m", "ps_service"]
