#!/bin/bash
# Build a DeepEP wheel (the V1 `deep_ep.Buffer` API that `--model.ep-dispatcher deepep` uses) on a GPU host.
#
#   bash benchmarks/build_deepep.sh SRC OUT_DIR       # SRC: a DeepEP checkout or a `git archive` tarball of one
#   pip install OUT_DIR/deep_ep-*.whl                 # or --target DIR on hosts without a writable site-packages
#
# SRC is DeepEP at tag v1.2.1 (`git clone -b v1.2.1 https://github.com/deepseek-ai/DeepEP`). Its main branch ("V2")
# replaced this API with JIT-compiled kernels on an NCCL >= 2.30 backend.
#
# Needs nvcc (CUDA 12.3+; 13.0 on our hosts), the CUDA toolkit headers, ninja and the torch the wheel will run with.
# DEEPEP_INTRANODE_ONLY=1 (default) builds the NVLink kernels only: all EP ranks on one host, which is every
# configuration of a single node. The internode (RDMA) and low-latency kernels need NVSHMEM *and* rdma-core's
# `infiniband/mlx5dv.h`; set DEEPEP_INTRANODE_ONLY=0 on hosts that have both (NVSHMEM from the nvidia-nvshmem-cu13
# wheel or NVSHMEM_DIR).
set -euo pipefail
src=$1
out=$(realpath -m "$2")
work=$(mktemp -d)
if [ -f "$src" ]; then
    tar xzf "$src" -C "$work"
    src=$(find "$work" -maxdepth 2 -name setup.py -printf '%h\n' | head -1)
else
    cp -r "$src" "$work/DeepEP" && src=$work/DeepEP
fi
cd "$src"
if [ "${DEEPEP_INTRANODE_ONLY:-1}" = 1 ]; then
    # setup.py enables NVSHMEM whenever the nvidia-nvshmem wheel is importable; pin it off instead.
    python3 - <<'PY'
from pathlib import Path
p = Path("setup.py")
s = p.read_text()
old = "disable_nvshmem = False\n    nvshmem_dir = os.getenv('NVSHMEM_DIR', None)"
assert old in s, "unexpected DeepEP setup.py: expected the v1.2.1 NVSHMEM switch"
s = s.replace(old, "disable_nvshmem = True\n    nvshmem_dir = None")
# Relocatable device code is only there to device-link NVSHMEM; without that link step the intranode kernels'
# registration symbols stay undefined at import.
rdc = "nvcc_flags.extend(['-rdc=true', "
assert rdc in s, "unexpected DeepEP setup.py: expected -rdc=true in the SM90 flags"
p.write_text(s.replace(rdc, "nvcc_flags.extend(["))
PY
    # With nvshmem_dir None the `try` below it still imports nvidia.nvshmem; harmless, the sources stay intranode.
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p "$out"
python3 -m pip wheel --no-build-isolation --no-deps --no-index -w "$out" . 2>&1 | tail -20
ls "$out"/deep_ep-*.whl
