"""The catalogue grown (issue #15): eight more faults, each broken and fixed on 2 real gloo ranks,
with torch's message verbatim or the measured evidence, and what doctor saw before launch."""
import pytest

from ddpkit import pitfalls
from test_pitfalls import both, pool  # noqa: F401  (pool: the module's warm ranks)

READY_TWICE = "Expected to mark a variable ready only once."


def kinds(findings):
    return [(f.pitfall, f.where) for f in findings]


# --- a real transformers model
def test_hf_gpt2_reentrant_find_unused(pool):
    pytest.importorskip("transformers")
    broken, fixed = both("hf_reentrant_find_unused", pool)
    assert broken.error_type == "RuntimeError" and broken.error.startswith(READY_TWICE)
    assert "with name transformer.h.1.mlp.c_proj.bias has been marked as ready twice" in broken.error
    assert broken.evidence["step"] == 0  # the first backward
    # transformers' own checkpointing turned use_cache off, and said so
    assert broken.evidence["transformers_said"] == [
        "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`."]
    # doctor saw the parameters hidden from the forward graph (and that GPT-2 needs no
    # find_unused_parameters at all)
    assert [f.pitfall for f in broken.findings] == ["reentrant_find_unused",
                                                    "find_unused_not_needed"]
    assert broken.findings[1].where == "(ddp_kwargs)"
    # both fixes run, with exactly the gradients of the same GPT-2 without checkpointing
    assert fixed.evidence == {"use_reentrant=False": {"max_grad_diff_vs_plain": 0.0},
                              "find_unused_parameters=False": {"max_grad_diff_vs_plain": 0.0}}


def test_hf_pitfall_says_why_it_skips_without_transformers(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_transformers(name, *args, **kw):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    r = pitfalls.run("hf_reentrant_find_unused")
    assert r.skipped.startswith("needs the transformers package (pip install 'ddpkit[hf]')")
    assert not r.clean and r.findings == [] and "skipped" in repr(r)


# --- accumulation loops with one mistake (4 micro-batches per step, 2 steps)
def test_no_sync_around_the_backward_only(pool):
    broken, fixed = both("no_sync_backward_only", pool)
    assert broken.error is None
    # no saving at all: an all-reduce per micro-batch, as without no_sync
    assert broken.evidence["allreduce_calls_per_step"] == [4, 4]
    assert fixed.evidence["allreduce_calls_per_step"] == [1, 1]
    for r in (broken, fixed):  # the weights are right either way
        assert r.evidence["max_grad_diff_vs_big_batch"] < 1e-6
        assert r.evidence["weight_diff_between_ranks"] == 0.0


def test_no_sync_on_the_last_micro_step_too(pool):
    broken, fixed = both("no_sync_last_too", pool)
    ev = broken.evidence
    assert broken.error is None and ev["allreduce_calls_per_step"] == [0, 0]
    assert ev["max_grad_diff_vs_big_batch"] > 1e-2  # each rank has only its own gradient
    assert ev["weight_diff_between_ranks"] > 1e-2  # after 2 SGD steps the ranks disagree
    assert fixed.evidence["allreduce_calls_per_step"] == [1, 1]
    assert fixed.evidence["weight_diff_between_ranks"] == 0.0


def test_zero_grad_inside_the_micro_loop(pool):
    broken, fixed = both("zero_grad_in_micro_loop", pool)
    ev = broken.evidence
    assert broken.error is None
    assert ev["max_grad_diff_vs_last_micro_batch"] == 0.0  # only the last micro-batch survives
    assert ev["max_grad_diff_vs_big_batch"] > 1e-2
    assert ev["grad_norm_ratio_vs_big_batch"] < 0.5
    assert fixed.evidence["max_grad_diff_vs_big_batch"] < 1e-6
    assert fixed.evidence["grad_norm_ratio_vs_big_batch"] == pytest.approx(1.0, rel=1e-5)
    assert fixed.evidence["max_grad_diff_vs_last_micro_batch"] > 1e-2


def test_forward_through_ddp_module(pool):
    broken, fixed = both("forward_through_module", pool)
    ev = broken.evidence
    assert broken.error is None and ev["allreduce_calls_per_step"] == [0, 0]
    assert ev["weight_diff_between_ranks"] > 1e-2
    assert fixed.evidence["allreduce_calls_per_step"] == [1, 1]
    assert fixed.evidence["weight_diff_between_ranks"] == 0.0
    assert fixed.evidence["max_grad_diff_vs_big_batch"] < 1e-6


# --- errors torch raises
def test_recompute_differs(pool):
    broken, fixed = both("recompute_differs", pool)
    assert broken.error_type == "CheckpointError" and broken.evidence["step"] == 0
    assert broken.error.startswith("torch.utils.checkpoint: A different number of tensors was "
                                   "saved during the original forward and recomputation.\n"
                                   "Number of tensors saved during forward: 3\n"
                                   "Number of tensors saved during recomputation: 0.")
    assert kinds(broken.findings) == [("recompute_differs", "(a checkpointed function)")]
    assert "backward raised CheckpointError" in broken.findings[0].message
    # torch's RNG decides the LayerDrop: restored for the recompute, gradients exactly right
    assert fixed.evidence == {"steps": 4, "max_grad_diff_vs_plain": 0.0}


def test_syncbatchnorm_on_cpu_ranks(pool):
    broken, fixed = both("syncbatchnorm_cpu", pool)
    assert broken.error_type == "ValueError"
    assert broken.error == "SyncBatchNorm layers only work with GPU modules"
    assert broken.evidence["step"] is None  # in DDP(model), before any step
    assert kinds(broken.findings) == [("syncbatchnorm_cpu", "bn")]
    ev = fixed.evidence
    assert ev["norm_class"] == "BatchNorm1d" and ev["num_batches_tracked"] == ev["steps"] == 2
    # plain BatchNorm: each rank's own batch statistics (no sync), visible after its forward
    assert ev["running_mean_diff_between_ranks"] > 1e-3


def test_static_graph_with_a_branch_on_some_steps(pool):
    broken, fixed = both("static_graph_changes", pool)
    assert broken.error_type == "RuntimeError"
    assert broken.error.startswith(
        "Expected to have finished reduction in the prior iteration before starting a new one. "
        "This error indicates that your training graph has changed in this iteration, e.g., one "
        "parameter is used in first iteration, but then got unused in the second iteration. "
        "this is not compatible with static_graph set to True.")
    assert "Parameter indices which did not receive grad for rank" in broken.error
    # step 1 (no branch) ran; the forward of step 2 found its reduction unfinished
    assert broken.evidence["step"] == 2
    assert broken.findings == []  # one step cannot show a graph that changes between steps
    assert fixed.evidence == {"branch_taken": [True, False, True, False],
                              "weight_diff_between_ranks": 0.0}
