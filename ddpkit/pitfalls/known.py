"""The catalogue: every known fault the lab can run, as data, in teaching order.

Each `Pitfall` says its symptom, its cause and its fix (the fixes shared with the doctor come from
`fixes`). `ddpkit.pitfalls.run(name)` shows one happen on real ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import fixes


@dataclass(frozen=True)
class Pitfall:
    """One known fault. ``silent``: it raises nothing, only numbers show it."""
    name: str
    title: str
    symptom: str
    cause: str
    fix: str
    silent: bool

    def __repr__(self):
        kind = "silent" if self.silent else "raises"
        return (f"{self.name} ({kind}): {self.title}\n  symptom: {self.symptom}\n"
                f"  cause:   {self.cause}\n  fix:     {self.fix}")


_CATALOG = [
    Pitfall("reentrant_find_unused",
            "reentrant checkpoint + find_unused_parameters=True",
            "backward raises 'Expected to mark a variable ready only once' in the first step",
            "a reentrant checkpoint runs its forward under no_grad, so its parameters are not in "
            "the graph DDP searches after forward: DDP marks them unused (ready), then the "
            "recompute in backward produces their gradients and marks them ready again",
            fixes.REENTRANT, silent=False),
    Pitfall("reentrant_shared_module",
            "a module used twice in forward, each use in its own reentrant checkpoint",
            "backward raises 'Expected to mark a variable ready only once'",
            "each reentrant checkpoint is its own backward pass, so the shared parameters' "
            "gradients are accumulated (and reported to DDP) once per use",
            fixes.REENTRANT, silent=False),
    Pitfall("reentrant_input_no_grad",
            "reentrant checkpoint whose input does not require grad",
            "no error, one UserWarning; the checkpointed parameters get no gradient and never "
            "train (with find_unused_parameters=True, which DDP's own error asks for, every step "
            "runs 'fine')",
            "reentrant checkpoint backpropagates only into inputs that require grad; the data "
            "(or a frozen embedding's output) does not, so its backward never runs",
            "use_reentrant=False, or checkpoint from a point whose input requires grad "
            "(after the first layer)", silent=True),
    Pitfall("default_use_reentrant",
            "checkpoint() called without use_reentrant",
            "a UserWarning saying it should be passed and that it will raise in the future; "
            "this torch still runs",
            "without the argument this torch picks the reentrant variant (and its DDP "
            "restrictions above), not the recommended non-reentrant one",
            fixes.DEFAULT_USE_REENTRANT, silent=True),
    Pitfall("loss_not_scaled",
            "gradient accumulation without loss / accum_steps",
            "training runs, but as if the learning rate were accum_steps times larger",
            "backward adds gradients over micro-batches; each micro-batch loss is a mean, so the "
            "sum is accum_steps times the big-batch gradient",
            "backward (loss / accum_steps)", silent=True),
    Pitfall("sync_every_micro_step",
            "gradient accumulation without no_sync()",
            "correct weights, but every micro-batch pays a full all-reduce",
            "DDP all-reduces in every backward unless told not to; only the last micro-batch's "
            "sum is needed",
            "wrap all but the last micro-batch in `with ddp_model.no_sync():`", silent=True),
    Pitfall("no_sync_with_static_graph",
            "no_sync() with static_graph=True (and/or reentrant checkpointing)",
            "the first backward raises an INTERNAL ASSERT in DDP's reducer "
            "(expect_autograd_hooks_)",
            "static_graph records which gradients arrive during the first iteration; under "
            "no_sync it records nothing and then expects hooks it never set up (a torch bug). "
            "Reentrant checkpointing with no_sync alone works in this torch",
            "sync every micro-batch of the first step (no no_sync there), then use no_sync; "
            "ddpkit.train does this", silent=False),
    Pitfall("batchnorm_in_checkpoint",
            "BatchNorm inside a checkpointed segment",
            "no error; running mean/var drift from the un-checkpointed model's, "
            "num_batches_tracked counts twice per step",
            "the recompute in backward runs BatchNorm's forward again in training mode, "
            "updating its running statistics a second time",
            fixes.BATCHNORM_IN_CHECKPOINT, silent=True),
    Pitfall("dropout_rng",
            "dropout inside checkpoint with preserve_rng_state=False",
            "no error; gradients differ from the un-checkpointed model's",
            "the recompute draws a new dropout mask, so backward differentiates a different "
            "network than forward ran",
            fixes.DROPOUT_RNG, silent=True),
    Pitfall("uneven_inputs",
            "one rank gets an extra batch",
            "the run hangs: the rank with more data waits in all-reduce for peers that are done "
            "(30 minutes, gloo's default timeout); ddpkit's watchdog ends it with RankStalled",
            "every backward's all-reduce needs every rank; a rank out of data never joins it",
            "equal batches per rank (DistributedSampler(drop_last=True)), or "
            "`with ddp_model.join():` around the loop", silent=False),
    Pitfall("rank_exception",
            "one rank raises mid-step",
            "the peers sit in a collective; when the culprit's process exits they fail with "
            "'Connection closed by peer', often the first error a launcher shows",
            "collectives wait for every rank; a dead rank never arrives",
            "fix the culprit's error: ddpkit names that rank with its own traceback (RankError) "
            "and ends the peers", silent=False),
    Pitfall("state_dict_prefix",
            "saving ddp_model.state_dict() and loading it into a plain model",
            "load_state_dict raises: missing 'stem.weight'..., unexpected 'module.stem.weight'...",
            "DDP keeps your model as its .module, so every key gains a 'module.' prefix",
            "save ddp_model.module.state_dict() on rank 0, then dist.barrier() before anyone reads "
            "it (or strip the prefix with torch.nn.modules.utils."
            "consume_prefix_in_state_dict_if_present)", silent=False),
    Pitfall("unused_parameters",
            "a parameter forward never uses, without find_unused_parameters",
            "the second step raises 'Expected to have finished reduction in the prior "
            "iteration before starting a new one'",
            "DDP waits for every parameter's gradient before it all-reduces the last bucket; an "
            "unused one never comes",
            fixes.UNUSED_PARAMETERS, silent=False),
    Pitfall("fork_after_cuda",
            "a fork-based launcher after the kernel touched CUDA",
            "each child raises 'Cannot re-initialize CUDA in forked subprocess'",
            "CUDA's state cannot be copied into a forked child; torch refuses to initialise it "
            "again there",
            "start ranks with spawn (ddpkit always does)", silent=False),
    Pitfall("notebook_fn_spawn",
            "plain mp.spawn of a function defined in a notebook",
            "each child dies with AttributeError: Can't get attribute 'work' on <module "
            "'__main__' (built-in)>; the parent only says a process exited with code 1",
            "spawn sends the function by name; a spawned child's __main__ is not the notebook, "
            "so the name is not there",
            "send the function by value (cloudpickle) to a module-level trampoline: "
            "ddpkit.launch", silent=False),
    Pitfall("hf_reentrant_find_unused",
            "a transformers model's own reentrant checkpointing + find_unused_parameters=True",
            "GPT-2 with activation_checkpointing_enable(activation_checkpointing_kwargs="
            "{'use_reentrant': True}) (gradient_checkpointing_enable before transformers 5) "
            "under DDP(find_unused_parameters=True): the first backward raises 'Expected to mark "
            "a variable ready only once' (the crash forum threads report)",
            "transformers checkpoints each block with torch's checkpoint as told: reentrant, so "
            "the block's parameters are missing from the forward graph DDP searches for unused "
            "ones; DDP marks them ready, then the recompute marks them ready again (the first "
            "entry, on a real model)",
            "use_reentrant=False in those kwargs (transformers 5's default; 4.x passed True), "
            "or find_unused_parameters=False (GPT-2 uses every parameter)", silent=False),
    Pitfall("lora_reentrant_no_input_grad",
            "LoRA (peft) adapters inside blocks checkpointed with use_reentrant=True",
            "torch warns 'None of the inputs have requires_grad=True. Gradients will be None'; "
            "the adapters in the checkpointed blocks get no gradient, and under DDP the next "
            "step raises 'Expected to have finished reduction in the prior iteration' (with "
            "find_unused_parameters=True it runs on, the adapters never training)",
            "get_peft_model freezes the whole base model, embeddings included, so the hidden "
            "states entering the first block require no grad; a reentrant checkpoint "
            "backpropagates only into inputs that require grad, so the block's backward (and "
            "its adapters' gradients) never runs. transformers' own checkpointing avoids it by "
            "calling enable_input_require_grads(); torch's checkpoint (ddpkit's checkpoint=, "
            "torch's checkpoint_wrapper) does not",
            fixes.LORA_REENTRANT, silent=False),
    Pitfall("no_sync_backward_only",
            "no_sync() around the backward only, not the forward",
            "accumulation runs and the weights are right, but every micro-batch still pays a "
            "full all-reduce: no saving at all",
            "DDP decides whether to all-reduce in forward (it reads no_sync's flag there and "
            "prepares the reducer); a backward under no_sync after a forward outside it syncs",
            "put the forward and the backward inside `with ddp_model.no_sync():`", silent=True),
    Pitfall("no_sync_last_too",
            "no_sync() on every micro-step, the last one too",
            "no error; the ranks' weights drift apart from the first optimizer step",
            "under no_sync DDP never all-reduces; each rank steps with its own gradient",
            "leave the last micro-batch of each step outside no_sync (its backward all-reduces "
            "the accumulated sum)", silent=True),
    Pitfall("zero_grad_in_micro_loop",
            "optimizer.zero_grad() inside the micro-batch loop",
            "no error; the step uses only the last micro-batch's gradient (scaled by "
            "1/accum_steps), not the big batch's",
            "zero_grad wipes what the earlier micro-batches accumulated",
            "zero_grad once per optimizer step, after optimizer.step()", silent=True),
    Pitfall("forward_through_module",
            "forward through ddp_model.module instead of ddp_model",
            "no error, no all-reduce; the ranks' weights drift apart",
            "DDP's forward is what prepares the reducer for the backward; the inner module's "
            "forward skips it, so the gradient hooks do nothing",
            "call ddp_model(x); use .module only to save or inspect the model", silent=True),
    Pitfall("recompute_differs",
            "a forward whose recompute differs from the original (non-reentrant checkpoint)",
            "backward raises CheckpointError: 'A different number of tensors was saved during "
            "the original forward and recomputation'",
            "the recompute runs the forward again; state that changed in between (here Python's "
            "`random`, which preserve_rng_state does not restore, deciding a LayerDrop) takes "
            "another path",
            fixes.RANDOM_IN_RECOMPUTE, silent=False),
    Pitfall("syncbatchnorm_cpu",
            "SyncBatchNorm on CPU ranks",
            "DDP(model) raises ValueError: 'SyncBatchNorm layers only work with GPU modules'",
            "SyncBatchNorm all-gathers batch statistics with kernels that exist for GPUs only; "
            "DDP refuses it on a CPU module",
            fixes.SYNCBATCHNORM_CPU, silent=False),
    Pitfall("static_graph_changes",
            "static_graph=True with a branch taken on some steps only",
            "the first step without the branch runs; the next forward raises 'Expected to have "
            "finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your training graph has changed in this iteration'",
            "static_graph=True promises DDP that the first iteration's set of used parameters "
            "holds for every iteration; a step that skips the branch leaves its gradients "
            "missing",
            "static_graph=False with find_unused_parameters=True (DDP searches the graph every "
            "step), or use every parameter on every step", silent=False),
]


def catalog():
    """Every `Pitfall` the lab can run, in teaching order."""
    return list(_CATALOG)


def get(name):
    for p in _CATALOG:
        if p.name == name:
            return p
    raise ValueError(f"no pitfall named {name!r}; pitfalls: {', '.join(p.name for p in _CATALOG)}")
