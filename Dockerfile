# One image for both services: `python -m ps_service` (the default command) and `python -m worker_service`.
# Dependencies are installed from pyproject.toml alone, before the code is copied, so a code change
# rebuilds in seconds. Plain Dockerfile syntax: builds with BuildKit and with the legacy builder.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

# Optional dependency groups of pyproject.toml to install: "mlp" (scikit-learn) lets workers run
# WORKER_TASK=mlp; `--build-arg EXTRAS=` gives a smaller image that runs the linear task only;
# EXTRAS=mlp,torch adds PyTorch (the cnn task, syncps.torch scripts) from TORCH_INDEX_URL, PyTorch's CPU
# wheels: PyPI's torch 2.13.0 for Linux brings several GB of CUDA libraries (docs/torch.md).
ARG EXTRAS=mlp
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml .
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = os.environ.get('EXTRAS', '').replace(',', ' ').split(); \
print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" \
      > /tmp/requirements.txt \
 && case ",$EXTRAS," in *,torch,*) set -- --extra-index-url "$TORCH_INDEX_URL" ;; *) set -- ;; esac \
 && pip install "$@" -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# A non-root user; /data/checkpoints belongs to it, so a fresh named volume mounted there does too.
RUN useradd --create-home --uid 10001 --user-group syncps \
 && mkdir -p /data/checkpoints && chown -R syncps:syncps /data
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
