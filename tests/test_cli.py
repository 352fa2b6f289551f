"""The command line: `python -m ddpkit train` spawns ranks, and the same command under torchrun
joins torchrun's ranks instead, with the same losses; `ddpkit demo` writes its report."""
import json
import socket
import time
import subprocess
import sys

import psutil
import pytest

import ddpkit
from ddpkit.cli import main
from procs import in_tmp

ARGS = ["--model", "mlp", "--n-blocks", "4", "--width", "32", "--micro-batch", "4",
        "--accum-steps", "2", "--checkpoint", "2", "--steps", "3"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_train_mirrors_trainconfig(tmp_path):
    out = tmp_path / "m.json"
    main(["train", *ARGS, "--json", str(out)])
    records = json.loads(out.read_text())
    cfg = ddpkit.TrainConfig(model="mlp", n_blocks=4, width=32, micro_batch=4, accum_steps=2,
                             checkpoint=2, steps=3)
    ref = ddpkit.train(cfg)
    loss = lambda recs: [round(m["loss"], 6) for m in recs if m["rank"] == 0]
    assert loss(records) == loss(ref.metrics)


def test_same_command_under_torchrun_gives_the_same_losses(tmp_path):
    out = tmp_path / "tr.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "ddpkit", "train", *ARGS, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=in_tmp(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    torchrun = json.loads(out.read_text())
    cfg = ddpkit.TrainConfig(model="mlp", n_blocks=4, width=32, micro_batch=4, accum_steps=2,
                             checkpoint=2, steps=3)
    ref = ddpkit.train(cfg)
    loss = lambda recs: [m["loss"] for m in recs if m["rank"] == 0]
    assert loss(torchrun) == pytest.approx(loss(ref.metrics), abs=1e-6)
    assert "final loss" in proc.stdout and "step=" not in proc.stdout  # the summary, no per-step lines
    assert "3/3" in proc.stderr  # global rank 0's progress bar


def test_cli_shows_a_progress_bar_and_a_summary_in_human_units(tmp_path, capsys):
    main(["train", *ARGS])
    out, err = capsys.readouterr()
    # tqdm on stderr: the bar reached the last step, with loss, memory and speed
    assert "3/3" in err and "100%" in err
    assert "loss " in err and " MiB" in err and "ms/step" in err
    # the summary on stdout, in KiB/MiB; no per-step records without --verbose
    assert "final loss" in out and "step time" in out and "activations" in out
    assert "KiB per rank" in out and "step=" not in out
    main(["train", *ARGS, "--verbose"])
    out, _ = capsys.readouterr()
    assert [line.split()[1] for line in out.splitlines() if line.startswith("rank=0 step=")] == [
        "step=0", "step=1", "step=2"]


def test_cli_prints_the_doctors_notes_and_warns_only_of_what_to_act_on(capsys, recwarn):
    """A transformers GPT-2 as it ships (use_cache=True), checkpointed: ddpkit switches the cache
    off, which the doctor notes after the summary; no warning, no yellow box."""
    pytest.importorskip("transformers")
    main(["train", "--model", "fixtures_module:make_gpt2", "--checkpoint", "2", "--steps", "1",
          "--micro-batch", "2", "--seq-len", "16", "--backend", "gloo", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert "final loss" in out
    notes = [line for line in out.splitlines() if line.startswith("note [")]
    assert len(notes) == 1 and notes[0].startswith(
        "note [hf_use_cache] at config.use_cache: use_cache=True")
    assert not [w for w in recwarn if "ddpkit.doctor" in str(w.message)]


def test_cli_config_error_names_the_field(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--checkpoint", "9", "--n-blocks", "4"])
    assert info.value.code == 2
    assert "TrainConfig.checkpoint=9: segments must be between 1 and n_blocks=4" in capsys.readouterr().err


def test_cli_checkpoint_text_error_names_the_forms(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--checkpoint", "half"])
    assert info.value.code == 2
    assert ("TrainConfig.checkpoint='half': write none, a segment count, full, or one 0/1 per "
            "block with commas (1,0,1,0,)") in capsys.readouterr().err


def test_to_torchrun_prints_a_cluster_command():
    cfg = ddpkit.TrainConfig(checkpoint=2, accum_steps=4, use_reentrant=True)
    cmd = cfg.to_torchrun(nproc_per_node=8, nnodes=4)
    assert cmd.startswith("torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d")
    assert "-m ddpkit train" in cmd and "--checkpoint 2" in cmd and "--accum-steps 4" in cmd
    assert "--use-reentrant" in cmd


def test_demo_writes_a_self_contained_report(tmp_path, capsys):
    """On a machine with no calibration (the tests' own cache folder is empty), with
    ``predict=None``: the runs, the report, and the step time said to be not predicted."""
    from ddpkit.runs.demo import demo
    out = tmp_path / "report.html"
    table = demo(out=str(out), steps=3, segments=[None, 2], n_blocks=4, width=32, seq_len=16,
                 progress=False, predict=None)
    text = out.read_text()
    assert len(table) == 2 and "Memory per rank vs checkpoint segments" in text
    assert "Pareto frontier" in text and "activations vs recompute" in text  # the trade-off
    assert "plotly" in text and "<script" in text and "cdn.plot.ly" not in text.split("<script")[1][:200]
    printed = capsys.readouterr().out
    assert "checkpoint" in printed and "IQR ms" in printed and "KiB" in printed
    assert "step time not predicted (this machine has no calibration" in printed
    assert table.predicted_step_ms.isna().all() and "step time not predicted" in text
    assert not list(tmp_path.glob(".tmp-*"))  # atomic write left no temp file


def listening(port, proc, timeout_s=90):
    """Wait until something listens on ``port`` (or ``proc`` has ended: its output says why)."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline and not any(
            c.laddr.port == port and c.status == psutil.CONN_LISTEN
            for c in psutil.net_connections(kind="tcp")):
        time.sleep(0.05)


def test_two_torchrun_nodes_on_loopback_give_the_same_losses(tmp_path):
    port = free_port()
    procs = []
    for node in (0, 1):
        out = tmp_path / f"node{node}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
               str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", f"ddpkit-{port}", "--local-addr", "127.0.0.1",
               "-m", "ddpkit", "train", *ARGS,
               "--json", str(out)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=in_tmp(tmp_path)))
        if node == 0:  # node 0 first: it hosts the rendezvous store on the endpoint
            listening(port, procs[0])
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [r[1][-1500:] for r in results]
    written = [f for f in tmp_path.glob("node*.json")]
    assert len(written) == 1  # only global rank 0 writes
    records = json.loads(written[0].read_text())
    cfg = ddpkit.TrainConfig(model="mlp", n_blocks=4, width=32, micro_batch=4, accum_steps=2,
                             checkpoint=2, steps=3)
    ref = ddpkit.train(cfg)
    loss = lambda recs: [m["loss"] for m in recs if m["rank"] == 0]
    assert loss(records) == pytest.approx(loss(ref.metrics), abs=1e-6)


@pytest.mark.parametrize("cfg", [
    ddpkit.TrainConfig(comm_hook="fp16", save_every=2, save_dir="ck", measure=["activations"],
                       checkpoint=[True, False, True, False]),
    ddpkit.TrainConfig(n_blocks=16, checkpoint=10),
    ddpkit.TrainConfig(n_blocks=1, checkpoint=[True]),
    ddpkit.TrainConfig(measure=False, use_reentrant=True, strategy="fsdp", optimizer="adamw"),
    ddpkit.TrainConfig(strategy="hsdp", shard_size=2, optimizer="adamw"),
    ddpkit.TrainConfig(comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=3),
])
def test_to_cli_parses_back_to_the_same_config(cfg):
    import argparse
    from ddpkit.cli import _config_from, _config_parser
    args = _config_parser(argparse.ArgumentParser()).parse_args(cfg.to_cli())
    assert _config_from(args) == cfg


def test_under_torchrun_devices_are_checked_against_this_machine_only(monkeypatch):
    # a 4-node job with 2 ranks here: world_size 8 must not be refused for lack of 8 local ranks
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("ddpkit.devices.cuda_gpus", lambda: [(8, 0)] * 2)
    cfg = ddpkit.TrainConfig(world_size=8, backend="nccl", device="cuda")
    assert cfg.world_size == 8
