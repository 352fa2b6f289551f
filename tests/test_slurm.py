"""`TrainConfig.to_slurm()`: an sbatch script a user submits as is. Its syntax; the script itself
run as two "nodes" on loopback (srun and scontrol played by two small scripts, torchrun and its
c10d rendezvous real); and, where SLURM and munge are installed and this runs as root, submitted
through ``sbatch`` to a one-machine SLURM cluster that the test starts and stops itself. Each run
gives the losses of ``ddpkit.train`` for the same config and seed."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ddpkit
from procs import in_tmp

CFG = dict(model="mlp", n_blocks=4, width=32, micro_batch=4, accum_steps=2, checkpoint=2, steps=3)
BIN = str(Path(sys.executable).parent)  # this environment's torchrun
# everything a run opens stays on loopback: torchrun's own address (PET_ is torchrun's prefix
# for its flags in the environment) and the gloo sockets of the ranks
LOOPBACK = {"PET_LOCAL_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(records):
    return [m["loss"] for m in records if m["rank"] == 0]


@pytest.fixture(scope="module")
def reference():
    return losses(ddpkit.train(ddpkit.TrainConfig(**CFG, world_size=2)).metrics)


def run_bounded(cmd, timeout, **kwargs):
    """Run ``cmd`` in its own session; on a timeout, end the whole session (nothing left)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[0]} ran past {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.mark.parametrize("kwargs", [
    dict(nodes=4, gpus_per_node=8, partition="gpu", account="proj", setup="module load cuda"),
    dict(nodes=1, gpus_per_node=0, nproc_per_node=2, json=None),
    dict(nodes=2, gpus_per_node=4, nproc_per_node=2, time="00:10:00", job_name="gpt-2x2"),
])
def test_the_script_is_valid_bash_with_one_torchrun_per_node(tmp_path, kwargs):
    cfg = ddpkit.TrainConfig(**CFG, use_reentrant=True)
    text = cfg.to_slurm(**kwargs)
    path = tmp_path / "job.sh"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    lines = text.splitlines()
    head = [line for line in lines if line.startswith("#SBATCH")]
    first_command = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    assert all(lines.index(line) < first_command for line in head)  # sbatch stops reading there
    assert f"#SBATCH --nodes={kwargs['nodes']}" in head and "#SBATCH --ntasks-per-node=1" in head
    assert ("#SBATCH --gpus-per-node=%d" % kwargs["gpus_per_node"] in head) == \
        bool(kwargs["gpus_per_node"])
    nproc = kwargs.get("nproc_per_node") or kwargs["gpus_per_node"]
    assert f"srun torchrun --nnodes \"$SLURM_NNODES\" --nproc-per-node {nproc} " in text
    assert "--rdzv-backend c10d" in text and '--rdzv-endpoint "$head:29500"' in text
    assert " ".join(cfg.to_cli()) in text and "--use-reentrant" in text


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(nodes=0, gpus_per_node=8), r"to_slurm\(nodes=0\): pass a whole number >= 1"),
    (dict(nodes=2, gpus_per_node=-1), r"to_slurm\(gpus_per_node=-1\): pass a whole number \(0: CPU"),
    (dict(nodes=2, gpus_per_node=0), r"to_slurm\(nproc_per_node=None\): CPU nodes.*nproc_per_node=2"),
    (dict(nodes=2, gpus_per_node=4, nproc_per_node=8), r"nproc_per_node=8\).*at most gpus_per_node"),
    (dict(nodes=2, gpus_per_node=4, port=80), r"to_slurm\(port=80\): pass a free TCP port"),
    (dict(nodes=2, gpus_per_node=4, job_name="my run"), r"job_name='my run'\): an #SBATCH value"),
    (dict(nodes=2, gpus_per_node=4, time=""), r"to_slurm\(time=''\): an #SBATCH value"),
])
def test_bad_slurm_settings_name_the_fix(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ddpkit.TrainConfig(**CFG).to_slurm(**kwargs)


FAKE_SRUN = """#!/bin/bash
# srun, one task per node: $SLURM_NNODES "nodes" on this machine, the first one first
pids=()
for ((n = 0; n < SLURM_NNODES; n++)); do
  SLURM_NODEID=$n SLURM_PROCID=$n SLURM_LOCALID=0 "$@" &
  pids+=($!)
  sleep 1
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames: every "node" is this machine
for ((n = 0; n < SLURM_NNODES; n++)); do echo 127.0.0.1; done
"""


def test_the_script_runs_as_two_nodes_on_loopback_with_the_losses_of_train(tmp_path, reference):
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(ddpkit.TrainConfig(**CFG).to_slurm(nodes=2, gpus_per_node=1,
                                                         port=free_port()))
    env = {**in_tmp(tmp_path), **LOOPBACK, "PATH": f"{fake}:{BIN}:{os.environ['PATH']}",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[0-1]"}
    rc, out = run_bounded(["bash", str(script)], 150, cwd=tmp_path, env=env)
    assert rc == 0, out[-3000:]
    records = json.loads((tmp_path / "ddpkit-4242.json").read_text())  # global rank 0's
    assert losses(records) == pytest.approx(reference, abs=1e-6)
    assert {m["rank"] for m in records} == {0}


# ------------------------------------------------------------ a real one-machine SLURM cluster
SLURM_CONF = """ClusterName=ddpkittest
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _wait_for(check, seconds, what, logs):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs if p.exists())
    pytest.fail(f"{what} within {seconds} s\n{tails}")


@pytest.fixture
def slurm_cluster(tmp_path):
    """munged, slurmctld and slurmd on this machine, on loopback, in this test's folder; all
    three are ended (and any job left cancelled) at teardown."""
    daemons = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
    missing = [d for d in daemons if shutil.which(d) is None]
    if missing:
        pytest.skip(f"no SLURM here ({', '.join(missing)} not found): on Debian, apt-get install "
                    f"slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs job steps as the submitting user, which needs root: run as root "
                    "to submit through a real sbatch")
    d = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(dir=d, ctld_port=free_port(), d_port=free_port(),
                                      cpus=os.cpu_count()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    logs = [d / "munged.log", d / "slurmctld.log", d / "slurmd.log"]
    procs = []

    def start(*cmd):
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))

    def idle():
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        return out.stdout.strip() == "idle"

    def jobs():
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
        return out.stdout.split()

    try:
        start("munged", "--foreground", "--force", f"--socket={d}/munge.socket",
              f"--key-file={key}", f"--log-file={logs[0]}", f"--pid-file={d}/munged.pid",
              f"--seed-file={d}/munged.seed")
        _wait_for(lambda: (d / "munge.socket").exists(), 10, "munged did not start", logs)
        start("slurmctld", "-D", "-i")
        start("slurmd", "-D", "-N", "localhost")
        _wait_for(idle, 30, "the SLURM node did not come up idle", logs)
        yield env
    finally:
        for job in jobs() if procs[1:] else []:
            subprocess.run(["scancel", job], env=env)
        if procs[1:]:
            _wait_for(lambda: not jobs(), 20, "jobs were still running at teardown", logs)
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_sbatch_runs_the_script_as_is_on_a_real_slurm_cluster(tmp_path, slurm_cluster, reference):
    work = tmp_path / "job"
    work.mkdir()
    script = work / "job.sh"
    # one node with two ranks on CPU: this machine is the cluster's only node, and has no GPU
    script.write_text(ddpkit.TrainConfig(**CFG).to_slurm(nodes=1, gpus_per_node=0,
                                                         nproc_per_node=2, port=free_port(),
                                                         time="00:05:00"))
    env = {**slurm_cluster, **LOOPBACK, "PATH": f"{BIN}:{os.environ['PATH']}"}
    rc, out = run_bounded(["sbatch", "--wait", "--parsable", str(script)], 180, cwd=work, env=env)
    job = out.strip().splitlines()[0].split(";")[0] if out.strip() else "?"
    log = work / f"ddpkit-{job}.out"
    assert rc == 0, (out, log.read_text()[-3000:] if log.exists() else "no job log")
    records = json.loads((work / f"ddpkit-{job}.json").read_text())
    assert losses(records) == pytest.approx(reference, abs=1e-6)
    assert "final loss" in log.read_text()  # rank 0's summary, in SLURM's output file
