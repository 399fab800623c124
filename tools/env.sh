# shellcheck shell=bash
# The environment every commkit tool and test runs under, set in this one place.
# Sourced by tools/setup_env.sh and tools/gpu.sh; read by tools/_env.py, which the benchmarks,
# tests/conftest.py and tests/_dist.py (for every worker process) use. Keep one `export NAME=VALUE`
# per line, nothing else but comments: tools/_env.py parses these lines.
#
# NVLink multicast (NVLS) stays off in NCCL, PyTorch's symmetric memory and NVSHMEM: on shared
# multi-GPU hosts a program that uses it can put the host's GPUs out of service, and every figure in
# the packages' BENCHMARKS.md was measured with it off.
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
