#!/usr/bin/env bash
# Ray Serve's HTTP extras (fastapi, starlette, uvicorn, grpcio, opentelemetry, ...) for the GPU
# machine, which has core Ray from ../shared/device but none of these and no package registry.
# Here (a machine that reaches PyPI), after `bash ../shared/device/stage.sh`:
#     bash scripts/device/stage_serve.sh
# writes .device/serve-site-cp312.tar.xz (~11 MB) and .device/serve_env.sh; on the GPU machine
#     source .device/env.sh && source .device/serve_env.sh && python3 scripts/gpu_http_serving.py
# httptools and uvloop are what `uvicorn[standard]` (through ray[serve]) gives the CPU machine: Serve's
# proxy parses with the first and Ray's async actors run on the second; without them the proxy's loop
# is pure Python and ~2x slower per request (issue 42's flood).
# Packages the GPU machine already has (pydantic from the kit; requests, protobuf and aiohttp
# from its own python) are left out: a second copy earlier on PYTHONPATH would shadow them.
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ -d .device ]] || { echo "run bash ../shared/device/stage.sh first" >&2; exit 1; }
pip=${PIP:-.venv/bin/pip}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$pip" download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$work/whl" \
  "fastapi>=0.133.0" "starlette>=1.0.1" "uvicorn>=0.26.0" httptools uvloop grpcio grpcio-reflection \
  prometheus_client opentelemetry-sdk opentelemetry-proto opentelemetry-exporter-prometheus \
  opencensus smart_open colorful mmh3 aiohttp_cors jinja2 watchfiles "pydantic==2.14.*"
mkdir "$work/site"
for w in "$work"/whl/*.whl; do
  case $(basename "$w") in
    pydantic*|typing_*|annotated_types*|requests-*|urllib3*|idna*|certifi*|charset_normalizer*|\
    protobuf*|aiohttp-*|aiohappyeyeballs*|aiosignal*|attrs*|frozenlist*|multidict*|propcache*|yarl*) continue ;;
  esac
  python3 -m zipfile -e "$w" "$work/site"
done
tar cJf .device/serve-site-cp312.tar.xz -C "$work/site" .
cat > .device/serve_env.sh <<'ENV'
# Source after .device/env.sh on the GPU machine: unpack Serve's HTTP extras once, add them to PYTHONPATH.
_kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -f /tmp/serve-site/.unpacked ]; then
  mkdir -p /tmp/serve-site && tar xJf "$_kit/serve-site-cp312.tar.xz" -C /tmp/serve-site && touch /tmp/serve-site/.unpacked
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/serve-site
python3 -c "import fastapi, uvicorn, starlette, grpc; from ray import serve; import httptools, uvloop; print('serve extras: fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'httptools', httptools.__version__, 'uvloop', uvloop.__version__)"
ENV
ls -la .device/serve-site-cp312.tar.xz
