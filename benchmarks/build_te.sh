#!/bin/bash
# Install NVIDIA Transformer Engine for PyTorch (`--model.fp8.backend te`) on a GPU host without network.
#
#   bash benchmarks/build_te.sh BUNDLE_DIR TARGET_DIR      # then: export PYTHONPATH=TARGET_DIR:$PYTHONPATH
#
# BUNDLE_DIR holds, downloaded on a machine with network (`pip download --no-deps ...`, the sdist from PyPI's files):
#   transformer_engine-<v>-py3-none-any.whl                   the Python package
#   transformer_engine_cu13-<v>-py3-none-manylinux_2_28_x86_64.whl   the prebuilt core library (CUDA 13)
#   transformer_engine_torch-<v>.tar.gz                        the torch extension: source only on PyPI, compiled
#                                                              here against the torch that will import it
#   nvidia_cudnn_frontend-*.whl, nvdlfw_inspect-*.whl          build / import requirements absent from our hosts
# With network, `pip install 'prime-models[fp8]'` does all of this (and, when NVIDIA publishes one for this torch,
# fetches a prebuilt extension instead of compiling).
#
# The extension builds for Hopper only (NVTE_CUDA_ARCHS=90) and without TE's NCCL expert-parallel ops, which prime
# does not use (its EP is prime_models.parallel.expert_parallel).
set -euo pipefail
bundle=$(realpath "$1")
target=$(realpath -m "$2")
# `pip install --target` skips every top-level directory that already exists there (transformer_engine/ holds the
# pieces of all three wheels), so each wheel goes to a fresh directory and is merged in; files already present in
# the target (e.g. another package's copy of cudnn-frontend) are kept.
merge_install() {
    local stage
    stage=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --target "$stage" "$@"
    python3 -c "import os, shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True,
        copy_function=lambda s, d: os.path.exists(d) or shutil.copy2(s, d))" "$stage" "$target"
    rm -rf "$stage"
}
merge_install "$bundle"/transformer_engine-*.whl "$bundle"/transformer_engine_cu13-*.whl \
    "$bundle"/nvidia_cudnn_frontend-*.whl "$bundle"/nvdlfw_inspect-*.whl
export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
export MAX_JOBS=${MAX_JOBS:-$(nproc)} NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} NVTE_WITH_NCCL_EP=0
# Without network the sdist's attempt to download a prebuilt wheel fails fast; force the source build anyway.
export NVTE_PYTORCH_FORCE_BUILD=TRUE
wheels=$(mktemp -d)
python3 -m pip wheel --no-build-isolation --no-deps --no-index -w "$wheels" "$bundle"/transformer_engine_torch-*.tar.gz 2>&1 | tail -5
merge_install "$wheels"/transformer_engine_torch-*.whl
python3 -c "import transformer_engine.pytorch as te; print('transformer_engine.pytorch ok:', te.Linear)"
