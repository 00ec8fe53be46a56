#!/bin/bash
# Install vLLM, verifiers and this tree's packages on a GPU host without network (device machines).
#
# Here:   ../shared/tools/offline-wheelhouse.sh .vw2 62 vllm==0.26.0 verifiers==0.4.0 wandb tomli-w rich \
#             matplotlib pyarrow jinja2 pillow pyzmq httpx-aiohttp
#         uv build --all-packages --wheel -o dist-gpu && git rev-parse --short HEAD > dist-gpu/BUILD_COMMIT
#         (a wheelhouse made before httpx-aiohttp was a dependency: pip download httpx-aiohttp --no-deps -d dist-gpu)
# There:  one call per part, each carrying it:  mkdir -p /tmp/stage && cp .vw3/pNN (re-split to 50 MiB: the tree travels too) /tmp/stage/
#         then (carrying dist-gpu):             bash benchmarks/gpu_setup.sh
#         and in every later call:              source /tmp/prime-env.sh
# Wheels (not PYTHONPATH=src) so that the vLLM plugin's entry point and the console scripts exist.
set -euo pipefail
cat /tmp/stage/p* > /tmp/w.tar
mkdir -p /tmp/w && tar xf /tmp/w.tar -C /tmp/w
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl dist-gpu/*.whl
# Byte-compile as a normal pip install does: every env worker and tool server is a fresh Python process.
python3 -m compileall -q -j 16 /tmp/site > /dev/null 2>&1 || true
cat > /tmp/prime-env.sh <<'ENV'
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
export PRIME_LAUNCH_BIN_DIR=/tmp/site/bin
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ENV
# The records name the commit the wheels were built from: the copied tree's git metadata can lag behind it.
if [ -f dist-gpu/BUILD_COMMIT ]; then echo "export PRIME_COMMIT=$(tr -cd '0-9a-f' < dist-gpu/BUILD_COMMIT)" >> /tmp/prime-env.sh; fi
source /tmp/prime-env.sh
python3 -c "import vllm, verifiers, prime_inference, prime_trainer; print('vllm', vllm.__version__, 'verifiers', verifiers.__version__)"
ls /tmp/site/bin | tr '\n' ' '
