"""Diagnose C++-exception-to-Python crashes: runs each case in a fresh subprocess and reports how it ended.

    python tools/probe_exceptions.py [--gdb]

Cases raise a commkit exception from each extension, with and without a CUDA context / NCCL
communicator in the process. A case that dies by a signal is the bug; with --gdb (when gdb exists)
the crashing cases are re-run under gdb for a native backtrace.
"""
import os
import shutil
import subprocess
import sys

CASES = {
    "fp8_value_nocuda": "import fp8_layerwise._C as C\ntry:\n C.ShmSegment.attach('/nonexistent-commkit')\nexcept Exception as e: print(type(e).__name__, e)",
    "elastic_value_nocuda": "import elastic_ep._C as C\ntry:\n C.destroy_nccl_comm(0)\nexcept ValueError as e: print('ValueError', e)",
    "elastic_value_torch": "import torch\nimport elastic_ep._C as C\ntry:\n C.destroy_nccl_comm(0)\nexcept ValueError as e: print('ValueError', e)",
    "elastic_value_cuda": "import torch\ntorch.ones(1, device='cuda')\nimport elastic_ep._C as C\ntry:\n C.destroy_nccl_comm(0)\nexcept ValueError as e: print('ValueError', e)",
    "elastic_value_cuda_first": "import elastic_ep._C as C\nimport torch\ntorch.ones(1, device='cuda')\ntry:\n C.destroy_nccl_comm(0)\nexcept ValueError as e: print('ValueError', e)",
    "ipc_value_cuda": "import torch\ntorch.ones(1, device='cuda')\nimport ipc_all2all._C as C\nprint([n for n in dir(C) if not n.startswith('_')][:40])",
    "std_exception_cuda": "import torch\ntorch.ones(1, device='cuda')\nimport elastic_ep._C as C\ntry:\n C.create_nccl_comm(b'x', 1, 0)\nexcept Exception as e: print(type(e).__name__, e)",
    "elastic_commerror_nccl": (
        "import os, tempfile, torch, torch.distributed as dist\n"
        "torch.cuda.set_device(0)\n"
        "dist.init_process_group('nccl', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1,"
        " device_id=torch.device('cuda', 0))\n"
        "import elastic_ep, elastic_ep._C as C\n"
        "b = elastic_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=32, hidden=256, num_topk=4,"
        " backend='native')\n"
        "rt = b.runtime._rt\n"
        "b.destroy()\n"
        "print('destroyed', flush=True)\n"
        "try:\n rt.check_healthy()\nexcept C.CommError as e: print('CommError', e, e.where)\n"
        "try:\n C.destroy_nccl_comm(0)\nexcept ValueError as e: print('ValueError', e)\n"
        "dist.destroy_process_group()"),
}


def main() -> int:
    use_gdb = "--gdb" in sys.argv and shutil.which("gdb")
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    bad = []
    for name, code in CASES.items():
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        status = "ok" if p.returncode == 0 else f"rc={p.returncode}"
        print(f"=== {name}: {status}\n{p.stdout.strip()[-600:]}\n{p.stderr.strip()[-1500:]}", flush=True)
        if p.returncode < 0:
            bad.append(name)
    if use_gdb:
        for name in bad:
            p = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, "-c",
                                CASES[name]], capture_output=True, text=True, env=env, timeout=300)
            print(f"=== gdb {name}\n{p.stdout[-6000:]}\n{p.stderr[-1500:]}", flush=True)
    print("crashing cases:", bad or "none")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
