"""The pitfall lab on real gloo ranks: every catalogue entry broken (the real torch message, or
measured evidence of the silent fault) and fixed (clean), with doctor's view of each setup."""
import pytest
import torch

import ddpkit
from ddpkit.runtime.pool import shared_pool
from ddpkit import pitfalls

READY_TWICE = "Expected to mark a variable ready only once."
REQUIRED = {"reentrant_find_unused", "reentrant_shared_module", "reentrant_input_no_grad",
            "default_use_reentrant", "loss_not_scaled", "sync_every_micro_step",
            "no_sync_with_static_graph", "batchnorm_in_checkpoint", "dropout_rng",
            "uneven_inputs", "rank_exception", "state_dict_prefix", "fork_after_cuda",
            "notebook_fn_spawn",
            # issue #15, grown (tests/test_more_pitfalls.py)
            "hf_reentrant_find_unused", "no_sync_backward_only", "no_sync_last_too",
            "zero_grad_in_micro_loop", "forward_through_module", "recompute_differs",
            "syncbatchnorm_cpu", "static_graph_changes"}


@pytest.fixture(scope="module")
def pool():
    # the kernel's shared warm ranks (pitfalls.run's default). Setups that crash or stall ranks
    # launch fresh and leave them alone.
    return shared_pool(2, "gloo", "cpu")


def both(name, pool):
    broken = pitfalls.run(name, fixed=False, pool=pool)
    fixed = pitfalls.run(name, fixed=True, pool=pool)
    assert broken.name == fixed.name == name and not broken.fixed and fixed.fixed
    assert fixed.clean, fixed
    assert fixed.findings == [], fixed.findings  # doctor: the fixed setup has no hazard
    return broken, fixed


def test_catalog_names_and_fields():
    cat = pitfalls.catalog()
    names = [p.name for p in cat]
    assert REQUIRED <= set(names) and len(names) == len(set(names)) and len(names) >= 23
    for p in cat:
        assert p.title and p.symptom and p.cause and p.fix, p
    silent = {p.name for p in cat if p.silent}
    assert silent == {"reentrant_input_no_grad", "default_use_reentrant", "loss_not_scaled",
                      "sync_every_micro_step", "batchnorm_in_checkpoint", "dropout_rng",
                      "no_sync_backward_only", "no_sync_last_too", "zero_grad_in_micro_loop",
                      "forward_through_module"}
    assert ddpkit.pitfalls.get("dropout_rng").silent
    with pytest.raises(ValueError, match=r"no pitfall named 'nope'; pitfalls: reentrant_find_unused"):
        pitfalls.run("nope")


def test_a_pool_that_is_not_two_gloo_ranks_is_refused():
    with ddpkit.Pool(1, backend="gloo", device="cpu") as one:
        with pytest.raises(ValueError, match=r"the pitfall lab \(2 CPU ranks with gloo\): "
                                             r"world_size=2 but the pool has 1 ranks"):
            pitfalls.run("loss_not_scaled", pool=one)


# --- reentrant checkpointing under DDP
def test_reentrant_find_unused(pool):
    broken, fixed = both("reentrant_find_unused", pool)
    assert broken.error_type == "RuntimeError" and broken.error.startswith(READY_TWICE)
    assert "with name block.0.bias has been marked as ready twice" in broken.error
    assert broken.culprit in (0, 1) and broken.evidence["step"] == 0
    assert [f.pitfall for f in broken.findings] == ["reentrant_find_unused"]
    for label in ("use_reentrant=False", "static_graph=True"):
        assert fixed.evidence[label]["max_grad_diff_vs_plain"] == 0.0
        # the unused layer that made find_unused_parameters=True necessary is still unused
        assert fixed.evidence[label]["params_without_grad"] == ["spare.weight", "spare.bias"]


def test_reentrant_shared_module(pool):
    broken, fixed = both("reentrant_shared_module", pool)
    assert broken.error.startswith(READY_TWICE)
    assert "2) Reused parameters in multiple reentrant backward passes." in broken.error
    assert "has been marked as ready twice" in broken.error
    assert [f.pitfall for f in broken.findings] == ["reentrant_shared_module"]
    assert broken.findings[0].where == "block.0"
    for label in ("use_reentrant=False", "static_graph=True"):
        assert fixed.evidence[label] == {"max_grad_diff_vs_plain": 0.0, "params_without_grad": []}


def test_reentrant_input_no_grad_is_silent(pool):
    broken, fixed = both("reentrant_input_no_grad", pool)
    assert broken.error is None  # silent: it runs
    ev = broken.evidence
    assert ev["params_without_grad"] == ["block.0.weight", "block.0.bias"]
    assert ev["block_weight_change"] == 0.0 and ev["head_weight_change"] > 1e-3  # 3 SGD steps
    assert ev["warnings"] == ["None of the inputs have requires_grad=True. Gradients will be None"]
    assert [f.pitfall for f in broken.findings] == ["reentrant_input_no_grad"]
    assert fixed.evidence["params_without_grad"] == [] and fixed.evidence["warnings"] == []
    assert fixed.evidence["block_weight_change"] > 1e-3


def test_default_use_reentrant(pool):
    broken, fixed = both("default_use_reentrant", pool)
    assert broken.error is None and broken.evidence["raised"] is False
    (warning,) = broken.evidence["warnings"]
    assert warning.startswith("torch.utils.checkpoint: the use_reentrant parameter should be "
                              "passed explicitly.")
    # what this torch does without the argument: the reentrant variant
    assert broken.evidence["checkpoint_node"] == "CheckpointFunctionBackward"
    assert broken.evidence["variant_used"] == "reentrant"
    assert [f.pitfall for f in broken.findings] == ["default_use_reentrant"]
    assert fixed.evidence["warnings"] == [] and fixed.evidence["variant_used"] == "non-reentrant"


# --- accumulation
def test_loss_not_scaled(pool):
    broken, fixed = both("loss_not_scaled", pool)
    assert broken.error is None
    assert broken.evidence["grad_norm_ratio"] == pytest.approx(4.0, rel=1e-5)  # accum_steps=4
    assert broken.evidence["max_grad_diff_vs_big_batch"] > 1e-2
    assert fixed.evidence["grad_norm_ratio"] == pytest.approx(1.0, rel=1e-5)
    assert fixed.evidence["max_grad_diff_vs_big_batch"] < 1e-6


def test_sync_every_micro_step(pool):
    broken, fixed = both("sync_every_micro_step", pool)
    assert broken.error is None
    # the same gradients either way, but 4 all-reduces instead of 1 (the tiny model is 1 bucket)
    assert broken.evidence["max_grad_diff_vs_big_batch"] < 1e-6
    assert broken.evidence["allreduce_calls"] == 4 and fixed.evidence["allreduce_calls"] == 1
    assert broken.evidence["allreduce_bytes"] == 4 * fixed.evidence["allreduce_bytes"] == 4 * 612
    assert fixed.evidence["big_batch_allreduce_calls"] == 1


def test_no_sync_with_static_graph(pool):
    broken, fixed = both("no_sync_with_static_graph", pool)
    assert broken.error.startswith("expect_autograd_hooks_ INTERNAL ASSERT FAILED at")
    assert "reducer.cpp" in broken.error and "please report a bug to PyTorch." in broken.error
    assert broken.evidence["step"] == 0
    assert broken.evidence["reentrant checkpoint + no_sync, no static_graph"] == "ok"
    assert fixed.evidence["allreduce_calls_per_step"] == [2, 1, 1]  # synced first step
    assert fixed.evidence["max_grad_diff_vs_plain"] < 1e-6


# --- silent numerics inside checkpoints
def test_batchnorm_in_checkpoint(pool):
    broken, fixed = both("batchnorm_in_checkpoint", pool)
    ev = broken.evidence
    assert broken.error is None
    assert (ev["num_batches_tracked"], ev["reference_num_batches_tracked"]) == (6, 3)  # 3 steps
    assert ev["running_mean_max_diff"] > 1e-3 and ev["running_var_max_diff"] > 1e-3
    assert ev["max_grad_diff_vs_plain"] == 0.0  # gradients are right; only the statistics drift
    assert [(f.pitfall, f.where) for f in broken.findings] == [("batchnorm_in_checkpoint", "bn")]
    assert fixed.evidence["num_batches_tracked"] == 3
    assert fixed.evidence["running_mean_max_diff"] == fixed.evidence["running_var_max_diff"] == 0.0


def test_dropout_rng(pool):
    broken, fixed = both("dropout_rng", pool)
    assert broken.error is None
    assert broken.evidence["max_grad_diff_vs_plain"] > 1e-2
    assert [(f.pitfall, f.where) for f in broken.findings] == [("dropout_rng", "drop")]
    assert fixed.evidence["max_grad_diff_vs_plain"] == 0.0


# --- ranks out of step
def test_uneven_inputs_stall_and_join(pool):
    broken, fixed = both("uneven_inputs", pool)
    assert broken.error_type == "RankStalled"
    assert broken.error.startswith("no progress for 6.0s from rank 0 (last step 2)")
    ev = broken.evidence
    assert ev["stalled_ranks"] == [0] and ev["last_steps"] == {0: 2}
    assert ev["steps_done"] == {0: 3, 1: 2}  # rank 0 started a third step rank 1 never joined
    assert ev["records_from_rank_1_while_rank_0_waited"] > 5  # rank 1 was alive, evaluating
    assert ev["ended_after_s"] < 30
    assert fixed.evidence["batches"] == 3
    a, b = fixed.evidence["weight_sums"]
    assert a == b  # join() shadowed rank 1's missing all-reduce: the weights agree


def test_rank_exception_names_the_culprit(pool):
    broken, fixed = both("rank_exception", pool)
    assert broken.error == "mat1 and mat2 shapes cannot be multiplied (4x7 and 8x8)"
    assert broken.culprit == 1 and broken.error_type == "RuntimeError"
    assert broken.evidence["step"] == 1
    # the peer had entered backward's all-reduce and never came back from it
    assert broken.evidence["peer_last_record"] == {"rank": 0, "step": 1, "phase": "backward"}
    # the peer's own error, when it arrived before the launcher ended it (usually): the
    # connection its all-reduce was on, closed by the culprit's end
    peers = broken.evidence["peers"]  # rank -> its error
    assert set(peers) <= {0} and all("Connection closed by peer" in p or "Connection reset" in p
                                     for p in peers.values()), peers
    assert fixed.evidence["returns"] == ["done", "done"]


def test_state_dict_prefix(pool):
    broken, fixed = both("state_dict_prefix", pool)
    assert broken.error.startswith("Error(s) in loading state_dict for CkptNet:")
    assert 'Missing key(s) in state_dict: "stem.weight"' in broken.error
    assert 'Unexpected key(s) in state_dict: "module.stem.weight"' in broken.error
    assert broken.evidence["saved_keys"][0] == "module.stem.weight"
    assert fixed.evidence["saved_keys"][0] == "stem.weight"
    assert fixed.evidence["max_weight_diff_after_load"] == 0.0


def test_unused_parameters(pool):
    broken, fixed = both("unused_parameters", pool)
    assert broken.error.startswith("Expected to have finished reduction in the prior iteration "
                                   "before starting a new one.")
    assert "Parameter indices which did not receive grad for rank" in broken.error
    assert broken.evidence["step"] == 1  # the first step ran; the second one found out
    assert [(f.pitfall, f.where) for f in broken.findings] == [("unused_parameters", "spare")]
    assert fixed.evidence["params_without_grad"] == ["spare.weight", "spare.bias"]


# --- launching
def test_notebook_fn_spawn():
    broken = pitfalls.run("notebook_fn_spawn")
    assert broken.error_type == "AttributeError"
    assert broken.error == "Can't get attribute 'work' on <module '__main__' (built-in)>"
    assert broken.evidence["parent_error"].startswith(
        "torch.multiprocessing.spawn.ProcessExitedException: process ")
    assert broken.evidence["parent_error"].endswith(" terminated with exit code 1")
    fixed = pitfalls.run("notebook_fn_spawn", fixed=True)
    assert fixed.clean and fixed.evidence == {"returncode": 0, "returns": "[0, 1]"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the pitfall runs")
def test_fork_after_cuda_says_it_was_skipped_without_cuda():
    broken = pitfalls.run("fork_after_cuda")
    assert broken.skipped.startswith("needs a CUDA GPU: torch.cuda.is_available() is False")
    assert not broken.clean and "skipped" in repr(broken)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fork_after_cuda():
    broken = pitfalls.run("fork_after_cuda")
    assert broken.error.startswith("Cannot re-initialize CUDA in forked subprocess.")
    fixed = pitfalls.run("fork_after_cuda", fixed=True)
    assert fixed.clean and "cuda:0" in fixed.evidence["returns"]


def test_result_reraises_the_real_error(pool):
    r = pitfalls.run("state_dict_prefix", pool=pool)
    with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict for CkptNet"):
        r.raise_()
    assert "state_dict_prefix (broken)" in repr(r) and "error (RuntimeError, rank 0)" in repr(r)


def test_pitfalls_load_lazily_and_every_doctor_finding_names_an_entry():
    import subprocess
    import sys

    # the doctor (ddpkit.pitfalls.doctor) comes with ddpkit; the catalogue, runners and rank code
    # load on first use
    code = ("import sys, ddpkit; "
            "assert not {'ddpkit.pitfalls.runs', 'ddpkit.pitfalls.ranks'} & set(sys.modules); "
            "print(len(ddpkit.pitfalls.catalog()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(len(pitfalls.catalog())), out.stderr
    import importlib
    import inspect
    import re

    source = "".join(inspect.getsource(importlib.import_module(f"ddpkit.pitfalls.{m}"))
                     for m in ("doctor", "rules"))
    named = set(re.findall(r'Finding\(\s*"(\w+)"', source))
    # each a catalogue entry (a warning) or one of the doctor's own notes, never both
    from ddpkit.pitfalls.rules import NOTES

    entries = {p.name for p in pitfalls.catalog()}
    assert named and named <= entries | set(NOTES), named - entries - set(NOTES)
    assert not entries & set(NOTES) and set(NOTES) <= named
