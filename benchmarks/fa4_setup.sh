#!/bin/bash
# Stage FlashAttention-4 (`flash-attn-4`, CuTe-DSL kernels) and the trainer's few missing dependencies on a GPU host
# without network, for `trainer_gpu.py` jobs with `_fa4` (`--init.attn flash_attn4`). Measured with it:
# benchmarks/results/trainer_gpu_h200_fa4.json.
#
# Here (flash-attn-4 is on PyPI but not on this index; its source is pure Python):
#   fetch github:Dao-AILab/flash-attention, then
#   mkdir -p .fa4/site && git -C <mirror> archive HEAD flash_attn/cute | tar x -C .fa4/site
#   pip download --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: -d .fa4/wheels \
#       nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
#       nvidia-cutlass-dsl-libs-cu13==4.8.1 'apache-tvm-ffi>=0.1.12,<0.2' torch-c-dlpack-ext quack-kernels==0.6.5 \
#       liger-kernel==0.8.5 pydantic pydantic-core annotated-types typing-inspection tomli-w pyzmq httpx2 httpcore2 \
#       sniffio truststore
#   (with .fa4/ in .git/info/exclude). The cu13 libs wheel is ~92 MB: split it (`split -b 46000000 -d -a 1 <whl> .fa4/c`)
#   and remove it from .fa4/wheels, since one call carries at most 64 MiB with the tree.
# There:  one call per chunk, back to back:   mkdir -p /tmp/fa4stage && cp .fa4/cN /tmp/fa4stage/   (carry .fa4/cN)
#         then (carry .fa4/wheels, .fa4/site): bash benchmarks/fa4_setup.sh; source /tmp/fa4-env.sh
set -euo pipefail
if ls /tmp/fa4stage/c* > /dev/null 2>&1; then
    cat /tmp/fa4stage/c* > .fa4/wheels/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
fi
mkdir -p /tmp/fa4site
# Unzipped over each other, not `pip install --target`: --target skips a top-level directory an earlier wheel made,
# and nvidia_cutlass_dsl/ comes from three wheels (base, core, cu13): `cutlass.cute` was then missing.
for w in .fa4/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/fa4site; done
cp -r .fa4/site/flash_attn /tmp/fa4site/
SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
# nvidia-cutlass-dsl puts its packages on sys.path through a .pth file, which a PYTHONPATH entry does not run.
cat > /tmp/fa4-env.sh <<ENV
export PYTHONPATH=$SRC$PWD:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ENV
source /tmp/fa4-env.sh
python3 -c "import torch; from prime_models import kernels; print('torch', torch.__version__, 'cudnn', \
torch.backends.cudnn.version(), 'flash-attn-4', kernels.HAS_FLASH_ATTN4)"
