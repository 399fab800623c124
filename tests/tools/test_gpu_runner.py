"""tools/gpu.sh, the one runner on a GPU machine, checked on the CPU through --dry-run (which prints the
settings and every command it would run, and builds, runs and writes nothing); the smoke marker's
selection; and tools/env.sh as the one place of the environment settings."""
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests._tools import ROOT, load_tool

GPU_SH = os.path.join(ROOT, "tools", "gpu.sh")
PKGS = ["fp8_layerwise", "ipc_all2all", "elastic_ep"]
SMOKE = "smoke and (gpu or multigpu)"
FULL = "gpu or multigpu"
FAULTS = "fault and (gpu or multigpu)"
NVLS_VARS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def _clean_env():
    env = dict(os.environ)
    # gpu.sh sets these unless they are set: the tests check its defaults (CI exports its own CUDAARCHS).
    for k in ("COMMKIT_REQUIRE_GPU", "COMMKIT_TEST_SHARE_GPU", "COMMKIT_GIT_REV", "PYTHON", "CUDAARCHS",
              "COMMKIT_BUILD_CUDA"):
        env.pop(k, None)
    return env


def gpu_sh(*args, cwd=None):
    return subprocess.run(["bash", GPU_SH, *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd or ROOT, env=_clean_env())


class Plan:
    """What a dry run would do: its printed commands, sorted into builds, test suites and benchmarks."""

    def __init__(self, proc):
        assert proc.returncode == 0, proc.stderr + proc.stdout
        self.text = proc.stdout
        self.commands = [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]
        self.builds = [c for c in self.commands if "pip" in c and "install" in c and "--no-build-isolation" in c]
        self.tests = [c for c in self.commands if "pytest" in c]
        self.benches = [c for c in self.commands if any(re.search(r"tools/bench_\w+\.py$", w) for w in c)]

    def built(self):
        return [os.path.basename(c[-1]) for c in self.builds]

    def tested(self):
        out = []
        for c in self.tests:
            path = next(w for w in c if w.startswith(os.path.join(ROOT, "tests") + os.sep))
            out.append(os.path.basename(path))
        return out

    def benched(self):
        return [re.search(r"bench_(\w+)\.py$", next(w for w in c if w.endswith(".py"))).group(1) for c in self.benches]


def _opt(cmd, flag):
    """The value of the last ``flag`` of ``cmd`` (``python -m pytest ... -m MARK``: the marker)."""
    return cmd[len(cmd) - 1 - cmd[::-1].index(flag) + 1]


def test_smoke_is_the_default_and_runs_the_smoke_marked_gpu_tests_of_every_package(tmp_path):
    out = tmp_path / "out"
    for args in ([str(out), "smoke", "--dry-run"], [str(out), "--dry-run"]):
        plan = Plan(gpu_sh(*args))
        assert plan.built() == PKGS
        assert all("--no-deps" in c for c in plan.builds)
        assert plan.tested() == PKGS and plan.benches == []
        for cmd, pkg in zip(plan.tests, PKGS):
            assert _opt(cmd, "-m") == SMOKE
            assert _opt(cmd, "-c") == os.path.join(ROOT, "pytest.ini")
            assert f"--junitxml={out}/junit_{pkg}.xml" in cmd
            assert cmd[:3] == ["timeout", "--kill-after=15", "540"]  # the default limit per suite
        assert plan.commands.count(["cd", "/tmp"]) == len(PKGS)  # the installed packages are imported
        for setting in ("COMMKIT_REQUIRE_GPU=1", "COMMKIT_TEST_SHARE_GPU=1", "COMMKIT_BUILD_CUDA=ON", "CUDAARCHS=90a",
                        "NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"):
            assert setting in plan.text.splitlines(), setting
        assert "ranks sharing a GPU" in plan.text
    assert not out.exists()  # a dry run writes nothing


@pytest.mark.parametrize("args,pkgs", [
    (["package=elastic_ep"], ["elastic_ep"]),
    (["package=ipc_all2all,fp8_layerwise"], ["ipc_all2all", "fp8_layerwise"]),
    (["--only", "fp8_layerwise,elastic_ep"], ["fp8_layerwise", "elastic_ep"]),
    (["--only=ipc_all2all"], ["ipc_all2all"]),
    ([], PKGS),
])
def test_full_runs_every_gpu_test_of_the_chosen_packages(tmp_path, args, pkgs):
    plan = Plan(gpu_sh(str(tmp_path / "o"), "full", *args, "--dry-run"))
    assert plan.built() == pkgs and plan.tested() == pkgs and plan.benches == []
    assert all(_opt(c, "-m") == FULL for c in plan.tests)


def _reports(plan):
    return [c for c in plan.commands if os.path.join(ROOT, "tools", "fault_report.py") in c]


@pytest.mark.parametrize("args,pkgs", [([], PKGS),
                                       (["package=elastic_ep,ipc_all2all"], ["elastic_ep", "ipc_all2all"])])
def test_faults_runs_the_fault_marked_gpu_tests_then_counts_them(tmp_path, args, pkgs):
    out = str(tmp_path / "o")
    plan = Plan(gpu_sh(out, "faults", *args, "--dry-run", "--", "-x"))
    assert plan.built() == pkgs and plan.tested() == pkgs and plan.benches == []
    assert all(_opt(c, "-m") == FAULTS and c[-1] == "-x" for c in plan.tests)
    # then tools/fault_report.py over the suites' junit files, after the last suite
    (report,) = _reports(plan)
    assert plan.commands.index(report) > plan.commands.index(plan.tests[-1])
    assert report[:3] == ["timeout", "--kill-after=15", "540"]
    assert report[5:] == [f"{out}/junit_{p}.xml" for p in pkgs] + ["--out", f"{out}/faults.json"]
    assert _reports(Plan(gpu_sh(out, "full", "--dry-run"))) == []  # only the faults preset reports


def test_bench_runs_the_benchmarks_only(tmp_path):
    out = str(tmp_path / "o")
    plan = Plan(gpu_sh(out, "bench", "--dry-run"))
    assert plan.benched() == PKGS and plan.tests == [] and plan.built() == PKGS
    assert all(_opt(c, "--out") == out and "--quick" not in c for c in plan.benches)
    plan = Plan(gpu_sh(out, "bench", "--quick", "package=elastic_ep", "--no-build", "--dry-run", "--", "--num-sms", "0,32"))
    assert plan.benched() == ["elastic_ep"] and plan.builds == []
    assert plan.benches[0][-5:] == ["--out", out, "--quick", "--num-sms", "0,32"]


def test_blocks_run_each_packages_block_script(tmp_path):
    # blocks: tools/block_<pkg>.py of every package into OUT/block_<pkg>; bench: the same after the benchmarks.
    out = str(tmp_path / "o")
    for preset, benched in (("blocks", []), ("bench", PKGS)):
        plan = Plan(gpu_sh(out, preset, "--dry-run"))
        blocks = [c for c in plan.commands if any(re.search(r"tools/block_\w+\.py$", w) for w in c)]
        scripts = [next(w for w in c if w.endswith(".py")) for c in blocks]
        assert scripts == [os.path.join(ROOT, "tools", f"block_{p}.py") for p in PKGS], scripts
        assert all(os.path.isfile(path) for path in scripts)
        for cmd, pkg in zip(blocks, PKGS):
            assert cmd[-2:] == ["--out", f"{out}/block_{pkg}"] and cmd[:3] == ["timeout", "--kill-after=15", "540"]
        assert plan.benched() == benched and plan.tests == []
        assert "-m" not in [w for c in blocks for w in c]  # no package demo: the blocks live in tools/


def test_preset_option_is_the_same_as_the_bare_name(tmp_path):
    for args in (["--preset", "bench"], ["--preset=bench"]):
        plan = Plan(gpu_sh(str(tmp_path), *args, "--dry-run"))
        assert plan.benched() == PKGS and plan.tests == []


def test_options_reach_the_commands(tmp_path):
    plan = Plan(gpu_sh(str(tmp_path), "smoke", "--no-build", "--timeout", "0", "--dry-run", "--", "-x", "-k", "tp1"))
    assert plan.builds == [] and len(plan.tests) == 3
    assert all(c[0] != "timeout" and c[-3:] == ["-x", "-k", "tp1"] for c in plan.tests)
    plan = Plan(gpu_sh(str(tmp_path), "full", "--timeout=120", "--dry-run"))
    assert all(c[:3] == ["timeout", "--kill-after=15", "120"] for c in plan.tests)


def test_a_relative_out_dir_is_made_absolute(tmp_path):
    # The suites run from /tmp: a relative OUT_DIR would put the logs somewhere else (or nowhere).
    plan = Plan(gpu_sh("rel/out", "full", "package=fp8_layerwise", "--dry-run", cwd=tmp_path))
    assert f"--junitxml={tmp_path}/rel/out/junit_fp8_layerwise.xml" in plan.tests[0]
    plan = Plan(gpu_sh("rel/out", "bench", "package=fp8_layerwise", "--dry-run", cwd=tmp_path))
    assert _opt(plan.benches[0], "--out") == f"{tmp_path}/rel/out"


@pytest.mark.parametrize("args,message", [
    ([], "OUT_DIR is missing"),
    (["smoke"], "the first argument is OUT_DIR"),
    (["--dry-run"], "the first argument is OUT_DIR"),
    (["o", "package=nope"], "package=: unknown package 'nope'"),
    (["o", "--only", "ipc_all2all,x"], "--only: unknown package 'x'"),
    (["o", "package="], "package=: no package named"),
    (["o", "smoke", "full"], "two presets given"),
    (["faults"], "the first argument is OUT_DIR"),
    (["o", "faults", "--quick"], "--quick applies to the bench preset only"),
    (["o", "smoke", "--quick"], "--quick applies to the bench preset only"),
    (["o", "--timeout", "soon"], "--timeout: expected whole seconds"),
    (["o", "--no-such-option"], "unknown argument '--no-such-option'"),
    (["o", "--preset", "fast"], "--preset: unknown preset 'fast'"),
])
def test_bad_usage_is_refused_with_a_reason(tmp_path, args, message):
    proc = gpu_sh(*args, "--dry-run", cwd=tmp_path) if args else gpu_sh(cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr and "usage: bash tools/gpu.sh OUT_DIR" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_help_describes_the_presets():
    proc = gpu_sh("--help")
    assert proc.returncode == 0
    for word in ("smoke", "full", "faults", FAULTS, "fault_report.py", "bench", "package=", "--no-build", "--quick",
                 "--timeout", "--dry-run"):
        assert word in proc.stdout, word


def _collect(*args):
    env = _clean_env()
    proc = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    return proc.returncode, [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_smoke_marker_selects_gpu_tests_of_every_package():
    rc, ids = _collect("-m", SMOKE, *(f"tests/{p}" for p in PKGS))
    assert rc == 0, ids
    names = {re.sub(r"\[.*\]$", "", i.split("::")[-1]) for i in ids}
    for p in PKGS:
        assert any(i.startswith(f"tests/{p}/") for i in ids), p
    # The short check of every package that the one-GPU smoke run did before: fp8_layerwise's GPU
    # tests, ipc_all2all's reference, validation and torch.compile tests, elastic_ep's EP 1 matrices
    # and bad-input test.
    assert {"test_gpu_tp1", "test_gpu_tp2_one_rank_per_gpu", "test_gpu_tp4_two_ranks_per_gpu",
            "test_gpu_ktransformers_design_and_default", "test_gpu_python_writer_error_then_reset",
            "test_gpu_sigkill_consumer", "test_matches_torch_nccl_path", "test_validation_before_launch", "test_torch_compile_fullgraph",
            "test_native_ep1_matrix", "test_lowlevel_ep1_modes", "test_dispatch_refuses_bad_inputs_native_ep1",
            "test_combine_refuses_bad_inputs_native_ep1"} <= names
    # smoke marks GPU tests only: the CPU suites are run by tools/test.sh
    rc, ids = _collect("-m", "smoke and not (gpu or multigpu)", "tests")
    assert rc == 5 and ids == [], ids


def test_the_fault_marker_selects_tests_of_every_package_on_either_machine():
    # The fault-injection suite: its GPU part (gpu.sh faults) and its CPU part (-m "fault and not (gpu or
    # multigpu)", which CI runs among every CPU test) hold tests of every package.
    gpu = {"test_survivor_names_a_dead_rank_at_once", "test_native_survivor_names_a_dead_rank_at_once",
           "test_a_handle_of_a_smaller_allocation_is_refused", "test_gpu_sigkill_consumer"}
    cpu = {"test_sigkill_consumer_detected_fast", "test_corrupted_peer_word_is_a_protocol_error_and_the_buffer_unusable",
           "test_a_malformed_record_fails_the_construction_on_every_rank_naming_the_rank",
           "test_real_rank_in_another_pid_namespace_is_alive_then_dead"}
    for mark, expected in ((FAULTS, gpu), ("fault and not (gpu or multigpu)", cpu)):
        rc, ids = _collect("-m", mark, *(f"tests/{p}" for p in PKGS))
        assert rc == 0, ids
        for p in PKGS:
            assert any(i.startswith(f"tests/{p}/") for i in ids), (mark, p)
        assert expected <= {re.sub(r"\[.*\]$", "", i.split("::")[-1]) for i in ids}, mark


# --- tools/env.sh, the one place of the environment settings ------------------------------------------

def test_env_sh_keeps_nvlink_multicast_off_for_the_shell_and_python_alike():
    env = load_tool("_env")
    values = env.settings()
    assert values == {**values, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}
    proc = subprocess.run(["bash", "-c", f'source {shlex.quote(env.ENV_SH)} && env -0'], capture_output=True,
                          text=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    shell = dict(item.split("=", 1) for item in proc.stdout.split("\0") if "=" in item)
    assert {k: shell.get(k) for k in values} == values
    target = {"NCCL_NVLS_ENABLE": "1"}
    assert env.apply(target) == values and target == values  # apply() overrides, as sourcing does


def test_env_sh_refuses_lines_python_cannot_read(tmp_path):
    env = load_tool("_env")
    bad = tmp_path / "env.sh"
    bad.write_text("# ok\nexport A=1\nexport B=\"$HOME\"\n")
    with pytest.raises(ValueError, match=r"env.sh:3: expected 'export NAME=VALUE'"):
        env.settings(str(bad))


def _repository_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return [f for f in out.split("\0") if f and os.path.isfile(os.path.join(ROOT, f))]
    except (OSError, subprocess.CalledProcessError):  # no git (e.g. an unpacked sdist): walk the tree
        skip = {".git", ".venv", "build", "out", "__pycache__", ".pytest_cache"}
        files = []
        for d, dirs, names in os.walk(ROOT):
            dirs[:] = [x for x in dirs if x not in skip and not x.endswith(".egg-info")]
            files += [os.path.relpath(os.path.join(d, n), ROOT) for n in names]
        return files


def test_no_file_but_env_sh_sets_the_nvlink_variables():
    # Documentation and recorded results may name them; code and scripts read tools/env.sh.
    docs = (".md", ".rst", ".txt", ".json", ".csv", ".log", ".png", ".svg", ".html")
    mine = os.path.relpath(os.path.abspath(__file__), ROOT)
    offenders = []
    for rel in _repository_files():
        if rel in ("tools/env.sh", mine) or rel.endswith(docs):
            continue
        try:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        offenders += [f"{rel}: {v}" for v in NVLS_VARS if v in text]
    assert offenders == [], "set these in tools/env.sh only (Python: tools/_env.py):\n" + "\n".join(offenders)


def test_the_tools_and_tests_read_env_sh():
    def read(rel):
        with open(os.path.join(ROOT, rel)) as f:
            return f.read()

    assert 'source "$ROOT/tools/env.sh"' in read("tools/gpu.sh")
    assert 'source "$COMMKIT_ROOT/tools/env.sh"' in read("tools/setup_env.sh")
    # tests/_dist.py spawns its ranks through tools/_launch.py, which gives every child env.sh's settings
    assert 'load_tool("_env")' in read("tests/conftest.py") and 'load_tool("_launch")' in read("tests/_dist.py")
    assert "from _env import settings" in read("tools/_launch.py")
    for bench in ("bench_elastic_ep", "bench_ipc_all2all"):
        assert "apply_env()" in read(f"tools/{bench}.py"), bench


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_gpu_sh_and_env_sh_are_shellcheck_clean():
    proc = subprocess.run(["shellcheck", "-x", "tools/gpu.sh", "tools/env.sh"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
