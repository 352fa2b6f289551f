"""The torch releases ddpkit supports, checked when ddpkit is imported, and every private torch
name it uses: where, and on which releases each was checked.

A private name (a leading underscore, or a name inside one of torch's private modules) can change
in any release without notice. Each one ddpkit reaches is listed in `PRIVATE` once, with the
module that uses it. ``tests/test_torch_private.py`` checks both ways: every listed name resolves
on the torch the tests run on, and no module of the package uses a private torch name missing
here. ``bench/torch_matrix.sh`` runs the quick tier on each release of `CHECKED`.

`check_torch` (run by ``import ddpkit``, in the kernel and in every rank) refuses a torch older
than `SUPPORTED`'s first release with one message that names the range and the fix, rather than
an ``AttributeError`` deep inside a run. A torch newer than the range is looked at: if a listed
name is gone the import fails naming it; else a warning says the release is unchecked.
``DDPKIT_TORCH_CHECK=0`` skips the check (at your own risk).
"""
from __future__ import annotations

import importlib
import os
import re
import warnings

import torch

SUPPORTED = ((2, 11), (2, 15))  # the oldest and the newest minor release checked
CHECKED = ("2.11.0", "2.13.0", "2.15.0")  # the quick tier passed on each (CPU; the matrix)

PRIVATE = {  # name -> where ddpkit uses it, and why
    # autograd and checkpointing
    "torch.utils.checkpoint._checkpoint_without_reentrant_generator":
        "engine/regions.py: one checkpoint region over several blocks of a loop you own",
    "torch.utils.checkpoint._enable_checkpoint_early_stop":
        "predict/trace.py: the early-stop switch, part of the FLOP count's memo key",
    "torch._C._autograd._top_saved_tensors_default_hooks":
        "engine/regions.py: the saved-tensor hooks in force (optional: none without it)",
    "torch.autograd.Variable._execution_engine.queue_callback":
        "engine/timeline.py: the end of the autograd pass, as DDP queues its finalizer",
    "torch._C._AutoDispatchBelowAutograd":
        "engine/collectives.py: on to a collective's own kernel after counting it",
    "torch.autograd.graph._engine_run_backward":
        "predict/attention.py: a CUDA rank's simulated backward, run as torch.autograd.backward "
        "runs it with the CUDA attention mode pushed again (its recompute sees CUDA's kernel)",
    "torch._C._current_autograd_node":
        "predict/fakeworld.py: an add run by autograd (a gradient summed), not by the model",
    "torch._prims_common.is_non_overlapping_and_dense_or_false":
        "predict/fakeworld.py: ... whose summand's storage it may reuse",
    "torch.utils._python_dispatch._disable_current_modes":
        "predict/datadep.py: a data-dependent op's size read outside the fake mode",
    "torch._subclasses.fake_tensor.FakeTensor": "predict/datadep.py: a fake tensor, by type",
    "torch.ops.aten._unique": "predict/datadep.py: a data-dependent size (unique)",
    "torch.ops.aten._unique2": "predict/datadep.py: a data-dependent size (unique)",
    "torch.ops.aten._grouped_mm":
        "predict/datadep.py, predict/trace.py: transformers' MoE experts (its FLOPs, its output)",
    "torch._meta_registrations._create_grouped_mm_output_tensor":
        "predict/datadep.py: torch._grouped_mm's output in fp32 (its meta takes bf16 only)",
    "torch.utils._pytree.tree_flatten": "engine/regions.py: a block's tensors",
    "torch.utils._pytree.tree_unflatten": "engine/regions.py: a block's tensors",
    "torch.utils._pytree.tree_leaves": "predict/simulate.py: the simulation's tensors",
    "torch.utils._pytree.tree_map": "predict/simulate.py, predict/trace.py: a batch made fake",
    "torch.utils._python_dispatch.TorchDispatchMode": "predict/simulate.py: the simulated step",
    "torch._subclasses.fake_tensor.FakeTensorMode":
        "spec/empty.py, predict/simulate.py, predict/trace.py: models and steps on fake tensors",
    "torch._subclasses.fake_tensor.is_fake": "engine/probes.py, predict/trace.py",
    "torch._subclasses.fake_tensor.unset_fake_temporarily": "spec/empty.py, predict/simulate.py",
    "torch.Tensor._version": "engine/regions.py: a block's input not written since",
    "torch.Tensor._is_zerotensor": "rank/returns.py: a plain tensor, sent out of band",
    "torch.Tensor._is_view":
        "predict/fakeworld.py: autograd never sums a gradient into a view (its base holds the storage)",
    "torch.UntypedStorage._cdata":
        "engine/memory.py, engine/probes.py, engine/regions.py, predict/simulate.py, "
        "predict/fakeworld.py: one key per storage (fake storages have no address)",
    "torch.nn.Module._parameters": "spec/empty.py, spec/model.py: a module's own tensors",
    "torch.nn.Module._buffers": "spec/empty.py, spec/model.py: a module's own tensors",
    "torch.nn.modules.batchnorm._BatchNorm": "pitfalls/observe.py: every batch norm",
    "torch.nn.modules.dropout._DropoutNd": "pitfalls/rules.py: every dropout",
    "torch._C._get_fp32_precision_getter": "rank/entry.py: the kernel's float32 precision",
    "torch._C._set_fp32_precision_setter": "rank/entry.py: ... set on each rank",
    "torch._dynamo.reset": "rank/fresh.py: a pool's rank forgets the last job's compiled code",
    "torch.serialization._get_layout": "engine/saving.py: a global a safe checkpoint may hold",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": "engine/saving.py: ... too",
    "torch.distributed.checkpoint.filesystem._StorageInfo": "engine/saving.py: ... too",
    # distributed
    "torch.distributed.distributed_c10d._set_pg_timeout":
        "rank/process_group.py, engine/strategies.py: a warm pool's groups retimed per job",
    "torch.distributed.ProcessGroup._get_backend": "engine/strategies.py: the job's timeout",
    "torch._C._distributed_c10d.Backend.Options._timeout":
        "engine/strategies.py: the job's timeout, for HSDP's groups",
    "torch.ops.c10d._allgather_base_":
        "engine/collectives.py: counted (FSDP's all-gather); predict/optrace.py: timed",
    "torch.ops.c10d._reduce_scatter_base_": "engine/collectives.py, predict/optrace.py",
    "torch.nn.parallel.DistributedDataParallel._get_ddp_logging_data":
        "engine/timeline.py: DDP's own runtime statistics beside the timeline",
    "torch.nn.parallel.DistributedDataParallel._set_ddp_runtime_logging_sample_rate":
        "engine/timeline.py: ... for every synced iteration",
    "torch.nn.parallel.distributed._verify_param_shape_across_processes":
        "predict/fakeworld.py: skipped on the fake group (it reads tensor data)",
    "torch.nn.parallel.distributed._sync_module_states": "predict/fakeworld.py: skipped too",
    "torch._C._distributed_c10d.Reducer._rebuild_buckets":
        "predict/fakeworld.py: the simulation keeps DDP's first bucket layout",
    "torch._C._distributed_c10d.FakeProcessGroup": "predict/fakeworld.py: the simulated world",
    "torch._C._distributed_c10d.FakeProcessGroup._create_internal": "predict/fakeworld.py",
    "torch.distributed.optim.ZeroRedundancyOptimizer._partition_parameters":
        "predict/simulate.py: the parameters each ZeRO-1 rank updates",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.foreach_all_gather":
        "predict/fakeworld.py: FSDP's buffers marked in the simulation (optional)",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.foreach_all_gather_copy_out":
        "predict/fakeworld.py (optional)",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.foreach_reduce":
        "predict/fakeworld.py (optional)",
    "torch.distributed.tensor._sharding_prop.ShardingPropagator"
    "._propagate_tensor_meta_non_cached":
        "predict/fakeworld.py: DTensor's metadata runs left out of the simulation (optional)",
    # aten ops the step-time trace knows by name (a renamed one would go untimed)
    "torch._ops.OpOverload._overloadpacket": "predict/optrace.py, predict/rates.py: an op's name",
    "torch._ops.OpOverload._schema": "predict/optrace.py: an op's argument names",
    "torch.ops.profiler._record_function_enter_new":
        "predict/optrace.py: a profiler range opens (the trace's named regions); "
        "predict/gpuplay.py: issued, no kernel",
    "torch.ops.profiler._record_function_exit": "predict/optrace.py, predict/gpuplay.py: ... closes",
    "torch.ops.aten._local_scalar_dense":
        "predict/gpuplay.py: a scalar read (.item()), the host waits for the stream; "
        "spec/empty.py's docstring",
    "torch._foreach_mul_": "predict/rates.py: the host's cost of issuing a foreach op",
    "torch.ops.aten._scaled_mm": "predict/optrace.py: a matmul",
    "torch.ops.aten._softmax": "predict/rates.py: a measured rate; predict/hardware.py: memory-bound",
    "torch.ops.aten._softmax_backward_data": "predict/hardware.py: a memory-bound op",
    "torch.ops.aten._log_softmax": "predict/hardware.py: a memory-bound op",
    "torch.ops.aten._log_softmax_backward_data": "predict/hardware.py: a memory-bound op",
    "torch.ops.aten._fused_rms_norm": "predict/hardware.py: a memory-bound op",
    "torch.ops.aten._fused_rms_norm_backward": "predict/hardware.py: a memory-bound op",
    "torch.ops.aten._unsafe_view": "predict/optrace.py: a view (free)",
    "torch.ops.aten._reshape_alias": "predict/optrace.py: a view (free)",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": "predict/optrace.py: attention",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": "predict/optrace.py: attention",
    "torch.ops.aten._scaled_dot_product_flash_attention": "predict/optrace.py: attention",
    "torch.ops.aten._scaled_dot_product_flash_attention_backward": "predict/optrace.py: attention",
    "torch.ops.aten._scaled_dot_product_efficient_attention": "predict/optrace.py: attention",
    "torch.ops.aten._scaled_dot_product_efficient_attention_backward": "predict/optrace.py: attention",
    "torch.ops.aten._scaled_dot_product_cudnn_attention": "predict/optrace.py: attention",
    "torch.ops.aten._scaled_dot_product_cudnn_attention_backward": "predict/optrace.py: attention",
    "torch.ops.aten._flash_attention_forward": "predict/optrace.py: attention",
    "torch.ops.aten._flash_attention_backward": "predict/optrace.py: attention",
    "torch.ops.aten._efficient_attention_forward": "predict/optrace.py: attention",
    "torch.ops.aten._efficient_attention_backward": "predict/optrace.py: attention",
    # profiler and CUDA
    "torch._C._profiler._ExtraFields_Allocation": "engine/memory.py: the CPU peak's allocations",
    "torch._C._autograd._ProfilerResult.experimental_event_tree": "engine/memory.py: ... in order",
    "torch._C._autograd._prepare_profiler":
        "engine/allocations.py: the peak probe's CPU window, enabled for the user's ranges only "
        "(torch.autograd.profiler.profile enables every op's)",
    "torch._C._autograd._enable_profiler": "engine/allocations.py: ... the window opens",
    "torch._C._autograd._disable_profiler": "engine/allocations.py: ... and closes",
    "torch._C._profiler.ProfilerConfig": "engine/allocations.py: ... its configuration",
    "torch._C._profiler.ProfilerState": "engine/allocations.py: ... KINETO",
    "torch._C._profiler.ProfilerActivity": "engine/allocations.py: ... CPU",
    "torch._C._profiler.RecordScope": "engine/allocations.py: ... USER_SCOPE",
    "torch._C._profiler._ExperimentalConfig": "engine/allocations.py: ... its defaults",
    "torch._C._profiler._EventType": "engine/allocations.py: ... an allocation's event",
    "torch.cuda.memory._record_memory_history": "engine/memory.py: TrainConfig.memory_snapshot",
    "torch.cuda.memory._dump_snapshot": "engine/memory.py: TrainConfig.memory_snapshot",
    "torch.cuda._get_nvml_device_index": "devices.py: a GPU's capability without a CUDA context",
}

# where a name lives on instances only (set in __init__): looked up on a small one
_INSTANCES = {"torch.nn.Module": lambda: torch.nn.Module(),
              "torch._ops.OpOverload": lambda: torch.ops.aten.add.Tensor}


def version_tuple(version):
    """``"2.11.0+cu130"`` -> ``(2, 11)``."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def resolve(name):
    """The object ``name`` (a dotted path from ``torch``) names on this torch; raises
    ``ImportError``/``AttributeError`` where it is gone."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for j in range(i, len(parts)):
        owner = ".".join(parts[:j])
        if not hasattr(obj, parts[j]) and owner in _INSTANCES:
            obj = _INSTANCES[owner]()
        obj = getattr(obj, parts[j])
    return obj


def missing():
    """The names of `PRIVATE` this torch lacks (importing what they live in)."""
    gone = []
    for name in PRIVATE:
        try:
            resolve(name)
        except (ImportError, AttributeError):
            gone.append(name)
    return gone


def _range():
    (a, b), (c, d) = SUPPORTED
    return f"torch {a}.{b} to {c}.{d} (checked on {', '.join(CHECKED)})"


def check_torch(version=None):
    """Refuse a torch ddpkit does not support, with the range and the fix (see the module)."""
    if os.environ.get("DDPKIT_TORCH_CHECK") == "0":
        return
    version = torch.__version__ if version is None else version
    have = version_tuple(version)
    lo, hi = SUPPORTED
    if have < lo:
        raise ImportError(
            f"ddpkit supports {_range()}; this Python has torch {version}, which lacks or "
            f"differs in private names ddpkit uses (ddpkit/torch_private.py lists them). "
            f"Install a supported torch: pip install 'torch>={lo[0]}.{lo[1]}' (for a CUDA "
            f"build, the index URL for your CUDA from pytorch.org); DDPKIT_TORCH_CHECK=0 "
            f"imports ddpkit anyway, at your own risk")
    if have > hi:
        gone = missing()
        if gone:
            raise ImportError(
                f"ddpkit supports {_range()}; torch {version} is newer and lacks private names "
                f"ddpkit uses: {', '.join(gone)}. Install torch<={hi[0]}.{hi[1]}, e.g. "
                f"pip install 'torch=={CHECKED[-1]}', or a ddpkit made for torch {version}")
        warnings.warn(f"ddpkit: torch {version} is newer than the releases ddpkit was checked on "
                      f"({', '.join(CHECKED)}); every private torch name it uses is there",
                      stacklevel=2)
