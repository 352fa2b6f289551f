"""LoRA under DDP with activation checkpointing (issue #24): a peft GPT-2 trains through
`train`, `sweep` and `estimate` on 2 gloo ranks, all-reducing only its adapters' gradients; the
reentrant failure is a pitfall (real 2-rank runs) and a doctor rule."""
import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

import fixtures_module as fm  # noqa: E402

import ddpkit  # noqa: E402
from ddpkit.runtime.pool import shared_pool  # noqa: E402
from ddpkit import pitfalls  # noqa: E402

CPU = dict(backend="gloo", device="cpu")


def lora_cfg(**kw):
    base = dict(model=fm.make_lora_gpt2, seq_len=16, micro_batch=2, world_size=2, steps=3,
                checkpoint=2, use_reentrant=False, optimizer="adamw", lr=1e-2, **CPU)
    return ddpkit.TrainConfig(**{**base, **kw})


def adapter_bytes():
    m = fm.make_lora_gpt2()
    return sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def pool():
    return shared_pool(2, "gloo", "cpu")  # the kernel's shared warm ranks, as train's default


def test_lora_gpt2_trains_with_checkpointing_and_all_reduces_only_its_adapters(pool):
    cfg = lora_cfg()
    table = ddpkit.sweep(cfg, pool=pool, progress=False, checkpoint=[None, 2])
    want = adapter_bytes()
    plain, ckpt = table.result[0], table.result[1]
    for m in ckpt.metrics:
        assert m["allreduce_bytes"] == want and m["grad_bytes"] == want
        # every collective of the step: the adapters' all-reduce (2(n-1)/n = 1 at 2 ranks), and
        # at step 1 DDP's broadcast of its rebuilt bucket order
        assert m["comm_by_op"]["allreduce"] == want
        assert m["optimizer_bytes"] == 2 * want  # AdamW's two moments, adapters only
    # checkpointing changes nothing but memory: the same losses and weights as without it
    def losses(res):
        return [m["loss"] for m in sorted(res.metrics, key=lambda m: (m["step"], m["rank"]))]
    assert losses(ckpt) == pytest.approx(losses(plain), abs=1e-6)
    assert max((ckpt.state_dict[k] - plain.state_dict[k]).abs().max().item()
               for k in plain.state_dict) <= 1e-6
    assert table.comm_by_op[1] == {"allreduce": want}  # the last step: the adapters alone
    assert table.activation_bytes[1] < table.activation_bytes[0]
    # the base model is frozen: its weights did not move; the adapters did
    import torch

    torch.manual_seed(cfg.seed)  # as every rank does before it builds the model
    base = fm.make_lora_gpt2().state_dict()
    moved = {k for k in base if (base[k] - ckpt.state_dict[k]).abs().max() > 0}
    assert moved and all("lora_" in k for k in moved)


def test_estimate_counts_adapters_for_gradients_and_optimizer():
    est = ddpkit.estimate(lora_cfg())
    want = adapter_bytes()
    m = fm.make_lora_gpt2()
    assert est.params == sum(p.numel() * 4 for p in m.parameters())
    assert est.grads == want and est.optimizer == 2 * want


def test_doctor_names_the_lora_reentrant_failure():
    found = ddpkit.doctor(lora_cfg(use_reentrant=True))
    lora = [f for f in found if f.pitfall == "lora_reentrant_no_input_grad"]
    assert lora and lora[0].severity == "warning"
    assert "enable_input_require_grads()" in lora[0].fix and "use_reentrant=False" in lora[0].fix
    assert "reentrant_input_no_grad" not in found.pitfalls  # said once, as LoRA's
    assert "lora_reentrant_no_input_grad" not in ddpkit.doctor(lora_cfg()).pitfalls


def test_lora_reentrant_pitfall_broken_and_fixed(pool):
    broken = pitfalls.run("lora_reentrant_no_input_grad", pool=pool)
    fixed = pitfalls.run("lora_reentrant_no_input_grad", fixed=True, pool=pool)
    assert broken.error_type == "RuntimeError"
    assert broken.error.startswith("Expected to have finished reduction in the prior iteration")
    ev = broken.evidence
    assert ev["torch_warned"] == ["None of the inputs have requires_grad=True. Gradients will "
                                  "be None"]
    assert ev["adapters_without_grad"] == [
        "base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight",
        "base_model.model.transformer.h.0.attn.c_attn.lora_B.default.weight"]
    assert broken.findings.pitfalls == ["lora_reentrant_no_input_grad"]
    # both fixes: every adapter gets exactly the gradient of the same model without checkpointing
    assert fixed.clean and fixed.findings == []
    assert fixed.evidence == {
        "use_reentrant=False": {"max_grad_diff_vs_plain": 0.0, "adapters_without_grad": 0},
        "enable_input_require_grads()": {"max_grad_diff_vs_plain": 0.0,
                                         "adapters_without_grad": 0}}


def test_lora_gpt2_peaks_where_simulated_and_runs_in_the_lab(pool):
    cfg = lora_cfg(steps=2)
    res = ddpkit.train(cfg, pool=pool)
    est = ddpkit.estimate(cfg)
    for m in res.metrics:
        want = est.peak(step=m["step"], rank=m["rank"]).bytes
        assert abs(m["peak_bytes"] - want) <= 0.03 * want, (m["rank"], m["step"])
    with ddpkit.Lab(cfg.replace(steps=3)) as lab:
        lab.run()
        row = lab.wait(timeout=180)
    assert row["status"] == "ok" and row["steps_done"] == 3
    # the history's bytes sent in the last step (step 1 adds DDP's rebuilt bucket order)
    assert row["comm_bytes"] == adapter_bytes()
