"""Named hardware (`predict/hardware.py`): a stated, sourced roofline per device and link; a
named GPU's rank simulated as the CUDA rank it is (foreach AdamW, the SDPA kernel CUDA picks,
FSDP2's streams) and played with CUDA's semantics (`gpuplay`); a GPU's calibration in the
`Machine` form. All on CPU: `bench/named_hardware.py` sets predictions beside published
throughput, `bench/gpu_step_time.py` beside a lent GPU's measured steps."""
import json
import math

import pytest

import ddpkit
from ddpkit.predict import calibrate, hardware, rates
from ddpkit.predict.machine import Machine
from ddpkit.predict.optrace import Op
from ddpkit.predict.peak import simulated
from ddpkit.predict.steptime import step_time

GPT = dict(model="gpt", n_blocks=4, width=256, seq_len=64, micro_batch=8, world_size=8,
           precision="bf16", optimizer="adamw")


def test_the_catalogue_states_units_and_a_source_for_every_figure():
    for d in hardware.DEVICES.values():
        assert 1e12 < d.fp32 <= d.bf16 < 1e16  # FLOP/s, dense
        assert 1e11 < d.bandwidth < 1e13  # bytes/s
        assert d.source and d.arch in hardware.EFFICIENCY and d.nvlink in hardware.LINKS
    assert hardware.DEVICES["H100-80GB"].bf16 == pytest.approx(989.4e12)  # 1,979 sparse / 2
    # a card as torch names it; a PCIe H100 has other peaks than the catalogue's SXM one
    assert hardware.device_for("NVIDIA A100-SXM4-40GB").name == "A100-40GB"
    assert hardware.device_for("NVIDIA H100 PCIe") is None
    for link in hardware.LINKS.values():
        assert 1e9 < link.bus < 1e12 and 0 < link.latency < 1e-4 and link.source
    rows = hardware.sources()
    assert all(unit and source for _, _, unit, source in rows)
    shares = [value for what, value, unit, _ in rows if unit == "of peak"]
    assert shares and all(0 < s <= 1 for s in shares)
    # every figure not from a data sheet or a paper says it is an assumption
    assert all("NVIDIA" in src or "arXiv" in src or "nccl" in src.lower() or "assumption" in src
               or "Lin" in src for _, _, _, src in rows)


def test_unknown_devices_and_links_and_a_missing_network_name_the_fix():
    cfg = ddpkit.TrainConfig(**GPT)
    with pytest.raises(ValueError, match="not a device ddpkit knows.*H100-80GB"):
        step_time(cfg, device="Z80")
    with pytest.raises(ValueError, match="link='fast'.*400Gbps"):
        hardware.network("fast")
    # 16 H100s span two nodes: the network between them is not NVLink, and must be named
    with pytest.raises(ValueError, match="spans 2 nodes.*link='400Gbps'"):
        step_time(cfg.replace(world_size=16), device="H100")


def test_a_multi_node_ring_runs_at_the_cards_pace_not_nvlinks():
    one_node = hardware.machine("H100")
    nbytes = 2**30
    inside = one_node.collective_s("allgather", nbytes, 8)
    slow = hardware.with_link(one_node, "100Gbps", 16).collective_s("allgather", nbytes, 16)
    ndr = hardware.with_link(one_node, "NDR", 16).collective_s("allgather", nbytes, 16)
    assert inside < ndr < slow
    # 8 cards of 100 Gbit/s carry 8 x 11.25 GB/s between two nodes: the ring's slower part
    assert slow == pytest.approx(nbytes * 16 / 17 * 15 / 16 / (8 * 11.25e9), rel=0.02)


def test_a_cuda_ranks_stream_runs_foreach_adamw_and_the_cuda_attention_kernel():
    cfg = ddpkit.TrainConfig(**{**GPT, "n_blocks": 2, "width": 64, "seq_len": 16})
    ops = [e for e in simulated(cfg, 0, hardware.target("H100")).stream if isinstance(e, Op)]
    attention = {e.name for e in ops if e.kind == "attention"}
    # bf16 on sm90, cuDNN older than 9.15: torch's flash kernel, not CPU's
    assert attention == {"_scaled_dot_product_flash_attention",
                         "_scaled_dot_product_flash_attention_backward"}
    assert all(e.causal for e in ops if e.kind == "attention")
    optimizer = {e.name for e in ops if e.phase == "optimizer" and e.kind == "memory"}
    assert "_foreach_addcdiv_" in optimizer and "addcdiv_" not in optimizer
    cpu = [e for e in simulated(cfg, 0).stream if isinstance(e, Op)]
    assert {e.name for e in cpu if e.kind == "attention"} == {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward"}


def test_fsdp_prefetches_the_next_blocks_all_gather_under_compute_on_a_named_gpu():
    # wide enough that the GPU, not the host issuing ops, sets the pace
    cfg = ddpkit.TrainConfig(**{**GPT, "strategy": "fsdp", "width": 2048, "seq_len": 1024})
    st = step_time(cfg, device="H100")
    tl = st.timeline
    gathers = tl[(tl.kind == "allgather") & (tl.micro_step == 0)].sort_values("start_s")
    blocks = tl[(tl.kind == "forward") & tl.name.str.startswith("block")].sort_values("start_s")
    # block i+1's all-gather starts while block i computes (FSDP2's own streams), so only
    # the first all-gathers and the last reduce-scatters are exposed
    for (_, block), (_, nxt) in zip(blocks.iloc[:-1].iterrows(), blocks.iloc[1:].iterrows()):
        ag = gathers[(gathers.end_s <= nxt.start_s + 1e-12)].iloc[-1]
        assert ag.start_s < block.end_s
    assert st.overlap > 0.5
    assert math.isclose(sum(st.ledger.values()), st.seconds, rel_tol=1e-9)


def _figures_measured_here():
    """A CUDA rank's figures (`rates.gpu_figures`' form), measured with the same functions on
    this machine's CPU at tiny sizes (the host's and a kernel's costs stated)."""
    return {"threads": 1, "gpu": "NVIDIA A100-SXM4-80GB", "capability": [8, 0],
            "gemm": {"bfloat16": rates.gemm_table("bfloat16", (8, 32), device="cpu")},
            "attention": {"bfloat16": rates.attention_points("bfloat16", device="cpu",
                                                             lengths=(16,), heads=(1, 2),
                                                             head_dim=8)},
            "memory": rates.memory_rates(device="cpu", sizes=(2**10, 2**14)),
            "overhead": dict(forward=1e-5, backward=5e-6, optimizer=1e-5, other=1e-5),
            "kernel_s": 3e-6}


def test_a_gpus_calibration_is_a_machine_the_cuda_player_times(tmp_path):
    m = calibrate.gpu_machine(_figures_measured_here(), world=1, key="test")
    assert m.kind == "cuda" and m.peak_flops["bfloat16"] == hardware.DEVICES["A100-80GB"].bf16
    assert m.collectives["link"][0] == hardware.LINKS["NVLink3"].bus  # one GPU: the catalogue's
    again = Machine.from_json(json.loads(json.dumps(m.to_json())))
    cfg = ddpkit.TrainConfig(**{**GPT, "n_blocks": 2, "width": 64, "seq_len": 16})
    st = step_time(cfg, device="A100", machine=again)
    assert st.machine == m.name and st.seconds > 0 and 0 < st.mfu < 1


def test_calibrate_measures_the_gpus_where_there_are_some(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPKIT_CACHE", str(tmp_path))
    made = Machine("stand-in for two GPUs' figures", kind="cuda")
    monkeypatch.setattr(calibrate, "cuda_gpus", lambda: [(9, 0), (9, 0)])
    monkeypatch.setattr(calibrate, "calibrate_gpu",
                        lambda key, world, progress: made if world == 2 and "2 GPU" in key
                        else None)
    assert calibrate.calibrate(progress=False) == made
    # kept per machine and GPUs: asked again, it comes from the cache
    monkeypatch.setattr(calibrate, "calibrate_gpu", lambda *a: pytest.fail("measured again"))
    assert calibrate.calibrate(progress=False).name == made.name
    # a config of CPU ranks on a GPU machine: the CPU's calibration, kept apart
    cpu = Machine("stand-in for the CPU ranks' figures")
    monkeypatch.setattr(calibrate, "_calibrate_cpu", lambda key, progress: cpu)
    assert calibrate.calibrate(progress=False, device="cpu") == cpu


def test_a_cuda_ranks_stream_carried_from_3_and_4_blocks_plays_as_the_whole():
    from ddpkit.predict import streams
    from ddpkit.predict.gpuplay import play_cuda
    from ddpkit.predict.simulate import simulate

    base = dict(model="gpt", width=32, seq_len=8, micro_batch=2, world_size=2,
                strategy="fsdp", optimizer="adamw", precision="bf16", checkpoint="full")
    t = hardware.target("H100")
    sims = {n: simulate(ddpkit.TrainConfig(n_blocks=n, **base), 0, target=t).stream
            for n in (3, 4, 6)}
    carried = streams.extend(sims[3], sims[4], 6)
    marks = lambda s: [(e.what, e.stream) for e in s if not isinstance(e, Op)]  # noqa: E731
    assert marks(carried) == marks(sims[6])  # FSDP2's events and streams, block by block
    # the foreach optimizer's ops, over lists one block longer, after one more block's reads
    # of its step counts
    moved = lambda s: sum(e.bytes for e in s if isinstance(e, Op) and e.phase == "optimizer")  # noqa: E731
    assert moved(carried) == moved(sims[6])
    # a slow link, so that each all-gather's place among the events decides the step
    slow = hardware.with_link(hardware.machine("H100"), None, 2)
    slow.collectives["link"] = [2e8, 1e-5]
    whole, built = (play_cuda(s, slow, ranks=2)[0] for s in (sims[6], carried))
    assert built == pytest.approx(whole, rel=2e-3)
