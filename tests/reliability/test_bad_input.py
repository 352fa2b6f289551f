"""Bad input, at every public entry point: a ValueError or TypeError that names the setting and
the fix, raised before any process starts (the autouse fixture would see one; this checks the
count directly too)."""
import socket
import threading

import pytest

import ddpkit
from procs import rank_children

CFG = ddpkit.TrainConfig(model="mlp", n_blocks=4, width=32, steps=2)


def work(ctx, x=None):
    return x


def _busy_port():
    """Bound at collection (the cases name its number), listening only while this module runs:
    under pytest-xdist every worker collects this module, and a listener held all session long
    would be seen by the other tests that list the process's sockets (tests/test_loopback.py)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # no SO_REUSEADDR: nobody else can bind the port from here on
    return s


BUSY = _busy_port()
PORT = BUSY.getsockname()[1]

CASES = [
    # launch / Pool
    ("launch", lambda: ddpkit.launch(work, world_size=0), ValueError, r"world_size=0: need at least 1 rank; pass world_size=1"),
    ("launch", lambda: ddpkit.launch(work, world_size=2.5), TypeError, r"world_size must be an int"),
    ("launch", lambda: ddpkit.launch(work, world_size=64, backend="nccl"), ValueError, r"nccl.*(no visible CUDA GPU|above the \d+ visible)"),
    ("launch", lambda: ddpkit.launch(work, device="tpu"), ValueError, r"device='tpu': pass 'cpu', 'cuda' or None"),
    ("launch", lambda: ddpkit.launch("work"), TypeError, r"launch\(\) needs a function"),
    ("launch", lambda: ddpkit.launch(work, threading.Lock()), TypeError, r"argument 1 \(lock\) cannot be sent to the ranks.*create it inside the function"),
    ("launch", lambda: ddpkit.launch(work, 1, 2, 3), TypeError, r"work\(ctx, \.\.\.\) cannot take these arguments"),
    ("launch", lambda: ddpkit.launch(work, port=PORT), ValueError, rf"port={PORT} is already in use.*pass port=None"),
    ("launch", lambda: ddpkit.launch(work, port=70000), ValueError, r"port=70000: pass a TCP port in 1\.\.65535"),
    ("launch", lambda: ddpkit.launch(work, stall_timeout_s=0), ValueError, r"stall_timeout_s=0: pass a number of seconds > 0, or None"),
    ("launch", lambda: ddpkit.launch(work, seed=1.5), TypeError, r"seed must be an int"),
    ("launch", lambda: ddpkit.launch(work, on_metric=3), TypeError, r"on_metric must be a callable"),
    ("launch", lambda: ddpkit.launch(work, block="no"), TypeError, r"block must be True or False"),
    ("Pool", lambda: ddpkit.Pool(world_size=0), ValueError, r"world_size=0: need at least 1 rank"),
    ("Pool", lambda: ddpkit.Pool(backend="mpi"), ValueError, r"backend='mpi' is not one of"),
    ("Pool", lambda: ddpkit.Pool(port=PORT), ValueError, rf"port={PORT} is already in use"),
    ("launch", lambda: ddpkit.launch(work, host=127001), TypeError, r"host must be an address string such as '127\.0\.0\.1', got 127001"),
    ("launch", lambda: ddpkit.launch(work, host="no-such-host.invalid"), ValueError, r"host='no-such-host\.invalid' does not resolve.*pass host='127\.0\.0\.1' \(the default: loopback only\)"),
    ("launch", lambda: ddpkit.launch(work, host="203.0.113.7"), ValueError, r"host='203\.0\.113\.7' is not an address of this machine.*pass host='127\.0\.0\.1'"),
    ("Pool", lambda: ddpkit.Pool(host=""), TypeError, r"host must be an address string"),
    # TrainConfig
    ("TrainConfig", lambda: ddpkit.TrainConfig(checkpoint=9), ValueError, r"TrainConfig.checkpoint=9: segments must be between 1 and n_blocks=4; pass checkpoint<=4"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(accum_steps=0), ValueError, r"TrainConfig.accum_steps=0: needs at least 1.*pass accum_steps=1 or more"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(accum_steps=-3), ValueError, r"TrainConfig.accum_steps=-3"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(micro_batch="4"), ValueError, r"TrainConfig.micro_batch='4': must be an int"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(world_size=0), ValueError, r"TrainConfig.world_size=0: needs at least 1"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(world_size=64, backend="nccl"), ValueError, r"(no visible CUDA GPU|above the \d+ visible)"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(steps=0), ValueError, r"TrainConfig.steps=0: must be a positive int; pass steps=1"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(lr=0), ValueError, r"TrainConfig.lr=0: must be > 0"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(dropout=1.0), ValueError, r"TrainConfig.dropout=1.0: must be in \[0, 1\)"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(model="vit"), ValueError, r"TrainConfig.model='vit': unknown model; pass one of"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(precision="int8"), ValueError, r"TrainConfig.precision='int8': unknown precision"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(checkpoint=[True]), ValueError, r"selective list needs exactly n_blocks=4 booleans"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(measure="all"), ValueError, r"TrainConfig.measure='all': must be True, False or a list"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(strategy="zero3"), ValueError, r"TrainConfig.strategy='zero3': unknown strategy"),
    ("TrainConfig", lambda: ddpkit.TrainConfig(save_every=3), ValueError, r"save_every=3 needs a folder; pass save_dir="),
    # train / sweep / estimate / doctor / lab / pitfalls
    ("train", lambda: ddpkit.train({"model": "mlp"}), TypeError, r"train\(\) takes a ddpkit.TrainConfig, got dict"),
    ("train", lambda: ddpkit.train(CFG, resume_from="/nonexistent"), ValueError, r"resume_from='/nonexistent': no complete checkpoint there"),
    ("sweep", lambda: ddpkit.sweep(CFG, checkpoint=2), ValueError, r"sweep: checkpoint= needs a non-empty list"),
    ("sweep", lambda: ddpkit.sweep(CFG, segments=[1]), ValueError, r"sweep: 'segments' is not a TrainConfig field"),
    ("sweep", lambda: ddpkit.sweep(CFG, checkpoint=[None, 9]), ValueError, r"TrainConfig.checkpoint=9: segments must be between"),
    ("estimate", lambda: ddpkit.estimate({"model": "mlp"}), TypeError, r"estimate\(\) takes a ddpkit.TrainConfig"),
    ("doctor", lambda: ddpkit.doctor(42), TypeError, r"doctor\(\) takes an nn.Module or a ddpkit.TrainConfig"),
    ("Lab", lambda: ddpkit.Lab("mlp"), TypeError, r"Lab\(\) takes a ddpkit.TrainConfig"),
    ("Lab", lambda: ddpkit.Lab(CFG, max_hz=0), ValueError, r"max_hz=0.*pass e.g. max_hz=5"),
    ("pitfalls.run", lambda: ddpkit.pitfalls.run("fork_bomb"), ValueError, r"no pitfall named 'fork_bomb'; pitfalls: "),
]


@pytest.fixture(scope="module", autouse=True)
def busy_port():
    BUSY.listen()  # a port in use, as a user meets it: someone is listening on it
    yield PORT
    BUSY.close()


@pytest.mark.parametrize("entry, call, exc, pattern", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_refused_with_the_field_and_the_fix(entry, call, exc, pattern):
    before = len(rank_children())
    with pytest.raises(exc, match=pattern):
        call()
    assert len(rank_children()) == before, f"{entry} started processes before refusing"
