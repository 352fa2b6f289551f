"""`TrainConfig`: every switch of a training run, checked when it is built.

A config is plain data (it binds to widgets, prints as a torchrun command). Errors name the field
and the fix, at construction, before any process starts. It is written in the words of
`ddpkit.spec` (model specs, `CheckpointSetting`, strategy names) and asks `devices` where it
would run; it imports nothing of the engine, and the engine never imports it: the kernel hands
the ranks `rank_plan()`, the `RankPlan` the engine reads.
"""
from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field

from .devices import check_bf16, local_share, resolve_devices, under_torchrun
from .slurm import sbatch_script
from .spec import model as spec
from .spec.blocks import paths_of
from .spec.builtin import build_builtin
from .spec.names import (COMM_HOOKS, MODELS, OPTIMIZERS, PRECISIONS, PROBES, STRATEGIES, is_fsdp,
                         strategy_problem)
from .spec.plan import RankPlan
from .spec.setting import CheckpointSetting


@dataclass
class TrainConfig:
    # --- model and data
    model: object = "mlp"
    """'mlp' (pre-norm residual MLP blocks) or 'gpt' (small causal transformer), the built-in
    teaching models; or your own: a callable returning an nn.Module (called on every rank after
    seeding from ``seed``; a notebook function ships by value), or an import path
    'package.module:make_model' (what the CLI and torchrun take)."""
    data: object = None
    """Your model's data: a callable ``data(cfg) -> Dataset`` (map-style, the same on every
    rank) or an import path. None: the built-in models' synthetic data, or synthetic tokens
    (``seq_len`` long) for a Hugging Face causal LM."""
    loss: object = None
    """``loss(model, batch) -> scalar``, or an import path. None: a dict batch calls
    ``model(**batch).loss`` (transformers); a tuple batch calls ``model(*batch)``."""
    blocks: object = None
    """Where the repeated blocks are that checkpointing and FSDP act on: the dotted path of their
    container ('transformer.h'), or several (['encoder.block', 'decoder.block'], or
    'encoder.block,decoder.block'); None finds every stack (each nn.ModuleList/nn.Sequential of
    blocks of one class that is not inside another; `cfg.info` lists them)."""
    n_blocks: int = 4
    """Number of identical blocks of a built-in model; for your own model it is read from the
    model (built once on the meta device, no memory used)."""
    width: int = 64
    """Hidden size D."""
    mlp_ratio: int = 4
    """Inner size of each block's MLP is mlp_ratio * width."""
    seq_len: int = 32
    """Tokens per sample (gpt only)."""
    vocab: int = 64
    """Vocabulary of the synthetic token data (gpt only)."""
    n_heads: int = 4
    """Attention heads (gpt only); must divide width."""
    dropout: float = 0.0
    """Dropout probability inside blocks."""
    # --- data parallel
    world_size: int = 2
    """Ranks (processes). One per GPU with NCCL, else CPU processes with gloo."""
    micro_batch: int = 4
    """Samples per rank per forward/backward."""
    accum_steps: int = 1
    """Micro-batches accumulated per optimizer step. Global batch = world_size*micro_batch*accum_steps."""
    no_sync: bool = True
    """Skip DDP's all-reduce on all but the last micro-batch (DDP.no_sync())."""
    static_graph: bool = False
    """DDP's ``static_graph``: the set of used parameters and the graph are the same every
    iteration, so DDP can skip re-checking them (and keep bucket order fixed after step 1)."""
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    """DDP's ``gradient_as_bucket_view``: gradients are views into the all-reduce buckets (no
    copy into the bucket, one gradient-sized buffer less)."""
    bucket_cap_mb: float | None = None
    """DDP's ``bucket_cap_mb``: gradients are all-reduced in buckets of at most this many MiB,
    each started as soon as its gradients are ready, so communication overlaps the rest of
    backward. None: torch's default (25 MiB, the first bucket 1 MiB)."""
    strategy: str = "ddp"
    """'ddp'; 'ddp_zero1' (DDP + ZeroRedundancyOptimizer: optimizer state sharded); 'zero2'
    (FSDP2 with reshard_after_forward=False: grads and optimizer state sharded, params whole
    through forward and backward); 'fsdp' (FSDP2 fully_shard per block, then the root: params,
    grads and optimizer state sharded: ZeRO-3); 'hsdp' (FSDP2 on a 2-D mesh: sharded within
    groups of shard_size ranks, replicated across them)."""
    shard_size: int | None = None
    """strategy='hsdp' only: ranks in each shard group (must divide world_size)."""
    comm_hook: str | None = None
    """DDP gradient compression: None, 'fp16' or 'bf16' (torch's *_compress_hook; bf16 needs
    NCCL), or 'powersgd' (torch's powerSGD_hook, error feedback on)."""
    powersgd_rank: int | None = None
    """comm_hook='powersgd' only: the rank of PowerSGD's low-rank approximation (None: 1)."""
    powersgd_start_iter: int = 2
    """comm_hook='powersgd' only: PowerSGD all-reduces uncompressed before this iteration (torch
    requires 2 or more with error feedback)."""
    # --- activation checkpointing
    checkpoint: object = None
    """None (off); an int s: s segments as torch's checkpoint_sequential counts them (the first
    s-1 are checkpointed, the last segment never is, so 1 checkpoints nothing); 'full' (every
    block); or a list of booleans, one per block (selective); or a setting's text form
    ('2 per stack', '1,0,1,0,'). The config holds it as a `CheckpointSetting` bound to the
    model's stacks (``cfg.checkpoint.label()``; it compares equal to the plain value)."""
    use_reentrant: bool = False
    """Passed to torch.utils.checkpoint explicitly (torch warns when it is not)."""
    preserve_rng_state: bool = True
    # --- numerics and optimizer
    precision: str = "fp32"
    """'fp32'; 'bf16' (autocast, CPU and CUDA); 'fp16' (autocast + GradScaler, CUDA only)."""
    optimizer: str = "sgd"
    """'sgd', 'adamw', or 'zero1' (AdamW sharded by torch's ZeroRedundancyOptimizer)."""
    lr: float = 0.05
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many steps (a LambdaLR, saved with checkpoints)."""
    steps: int = 10
    """Optimizer steps."""
    seed: int = 0
    # --- where and what to measure
    backend: str | None = None
    device: str | None = None
    measure: object = True
    """True: every probe (activation bytes, peak memory, all-reduce counts); False: none (a bare
    timing run); or a list naming some of 'activations', 'peak', 'comm'."""
    save_every: int = 0
    """Save a checkpoint every N optimizer steps into save_dir (0: never)."""
    save_dir: str | None = None
    peak_every: int = 25
    """Peak memory is probed at the run's first two steps (0: the optimizer state is made; 1:
    DDP rebuilds its buckets), every peak_every steps after step 1, and at the step a mid-run
    change lands (every step on CUDA, where it is free). On CPU the probe opens a
    profiler window, which lengthens that one step by about a third; 1 probes every step. Activation
    bytes are measured at the first step, every peak_every steps and at a change, and each
    record carries the last measurement (they depend only on the setting and the batch shapes)."""
    timeline_every: int = 50
    """Record a timeline (forward and backward per block, recompute, each bucket's all-reduce,
    the optimizer) on steps every-1, 2*every-1, ... (1: every step; 0: off); `TrainResult.
    timeline`. Hooks are installed for those steps only; a probed step costs a few percent
    more, so 1 in 50 keeps the median step within bench/overhead.py's 1.03x."""
    link_gbps: float | None = None
    """A **simulated** network: each bucket's all-reduce finishes no sooner than a ring
    all-reduce over links of this many Gbit/s would (2(N-1)/N x bytes; buckets one after
    another). None: as fast as the real transport (on one machine, loopback). Gloo only."""
    link_latency_us: float = 0.0
    """Latency of the simulated link per message, paid 2(N-1) times per ring all-reduce."""
    memory_snapshot: str | None = None
    """A folder: on CUDA, step 1 (the steady state) runs with the caching allocator's history
    recorded, written as ``rank{r}-step1.pickle`` for https://pytorch.org/memory_viz (each
    block, its size and the stack that made it). CUDA only: on CPU the peak's ledger says what
    the peak is made of."""
    stall_timeout_s: float = 120.0
    routing: str = "balanced"
    """What predictions assume of data-dependent routing (mixture of experts; training never
    reads it): 'balanced' (each expert gets tokens*k/E) or 'worst' (one expert gets every token:
    the upper bound; `ddpkit.predict.datadep`)."""
    extra: dict = field(default_factory=dict, repr=False)
    """Free-form tags carried into results (not used by the engine)."""

    def __post_init__(self):
        # in the order a reader would check them: what to train, how big, how to train it,
        # what to keep and measure, and last where (the device questions need the rest)
        self._check_model()
        self._check_sizes()
        self._check_training()
        self._check_saving_and_probes()
        self._check_timeline()
        # one value type checks it, bound to the model's stacks: the config holds the setting
        self.checkpoint = CheckpointSetting.of(self.checkpoint, self._stacks())
        self._check_devices()

    def _bad(self, name, why, fix):
        raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: {why}; {fix}")

    def _check_sizes(self):
        for name in ("n_blocks", "width", "mlp_ratio", "seq_len", "vocab", "n_heads", "steps",
                     "peak_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self._bad(name, "must be a positive int", f"pass {name}=1 or more")
        for name, what in (("micro_batch", "samples per rank per micro-step"),
                           ("accum_steps", "micro-batches per optimizer step"),
                           ("world_size", "ranks")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                self._bad(name, f"must be an int ({what}), got {type(value).__name__}",
                          f"pass e.g. {name}=2")
            if value < 1:
                self._bad(name, f"needs at least 1 ({what})", f"pass {name}=1 or more")
        if self.model == "gpt" and self.width % self.n_heads:
            self._bad("n_heads", f"must divide width={self.width}",
                      "pick n_heads that divides width")
        if not 0.0 <= self.dropout < 1.0:
            self._bad("dropout", "must be in [0, 1)", "pass e.g. dropout=0.1")

    def _check_training(self):
        """Precision, optimizer, strategy and communication hook, and how they combine."""
        bad = self._bad
        if self.precision not in PRECISIONS:
            bad("precision", "unknown precision", f"pass one of {PRECISIONS}")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", "unknown optimizer", f"pass one of {OPTIMIZERS}")
        if not self.lr > 0:
            bad("lr", "must be > 0", "pass e.g. lr=0.05")
        if self.strategy not in STRATEGIES:
            bad("strategy", "unknown strategy", f"pass one of {STRATEGIES}")
        if is_fsdp(self.strategy) and self.optimizer == "zero1":
            bad("optimizer", f"zero1 shards the optimizer of DDP; {self.strategy} (FSDP2) shards "
                "it already", f"pass optimizer='adamw' with strategy='{self.strategy}', or "
                "strategy='ddp_zero1'")
        if self.comm_hook not in COMM_HOOKS:
            bad("comm_hook", "unknown hook", f"pass one of {COMM_HOOKS}")
        if self.routing not in ("balanced", "worst"):
            bad("routing", "unknown routing assumption", "pass 'balanced' or 'worst'")
        if self.comm_hook and is_fsdp(self.strategy):
            bad("comm_hook", f"DDP communication hooks do not apply to FSDP2 "
                f"(strategy='{self.strategy}')", f"pass comm_hook=None with "
                f"strategy='{self.strategy}', or strategy='ddp'")
        self._check_hsdp_and_powersgd()

    def _check_hsdp_and_powersgd(self):
        """``shard_size`` (hsdp) and PowerSGD's rank and first compressed iteration."""
        problem = strategy_problem(self.strategy, self.world_size, self.shard_size,
                                   self.comm_hook, self.powersgd_rank, self.powersgd_start_iter)
        if problem:
            self._bad(*problem)

    def _check_saving_and_probes(self):
        for name in ("warmup_steps", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                self._bad(name, "must be an int >= 0", f"pass {name}=0 (off) or more")
        if self.save_every and not self.save_dir:
            self._bad("save_dir", f"save_every={self.save_every} needs a folder",
                      "pass save_dir='checkpoints' (or save_every=0)")
        if not isinstance(self.measure, bool):
            if not isinstance(self.measure, (list, tuple)) or not set(self.measure) <= set(PROBES):
                self._bad("measure", "must be True, False or a list of probe names",
                          f"pass e.g. measure=['activations'] (probes: {PROBES})")
            self.measure = list(self.measure)

    def _check_timeline(self):
        """The DDP knobs the timeline shows, and the simulated link."""
        v = self.timeline_every
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            self._bad("timeline_every", "must be an int >= 0", "pass timeline_every=0 (off), "
                      "1 (every step) or e.g. 10")
        for name, none in (("bucket_cap_mb", "torch's 25 MiB"), ("link_gbps", "no simulated link")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, (int, float)) or not value > 0):
                self._bad(name, "must be a number > 0 or None", f"pass e.g. {name}=1 (None: {none})")
        lat = self.link_latency_us
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or lat < 0:
            self._bad("link_latency_us", "must be a number >= 0", "pass e.g. link_latency_us=5")
        if is_fsdp(self.strategy):
            for name in ("bucket_cap_mb", "link_gbps", "link_latency_us"):
                if getattr(self, name):
                    self._bad(name, "acts on DDP's buckets and comm hook; FSDP has neither",
                              f"pass {name}={'0' if name == 'link_latency_us' else 'None'} with "
                              f"strategy='{self.strategy}', or strategy='ddp'")
        if self.comm_hook == "powersgd" and (self.link_gbps or self.link_latency_us):
            self._bad("link_gbps", "the simulated link times each bucket's bytes; PowerSGD's "
                      "vary within a bucket", "pass link_gbps=None, link_latency_us=0 with "
                      "comm_hook='powersgd'")

    def _check_model(self):
        if isinstance(self.model, str) and ":" not in self.model and self.model not in MODELS:
            raise ValueError(f"TrainConfig.model={self.model!r}: unknown model; pass one of "
                             f"{MODELS}, a callable returning an nn.Module, or an import path "
                             f"'package.module:make_model'")
        if self.builtin:
            for name in ("data", "loss"):
                if getattr(self, name) is not None:
                    raise ValueError(f"TrainConfig.{name}= is for your own model; the built-in "
                                     f"model={self.model!r} brings its own: pass {name}=None")
            if self.blocks not in (None, "blocks"):
                raise ValueError(f"TrainConfig.blocks={self.blocks!r}: the built-in models keep "
                                 f"their blocks in 'blocks'; pass blocks=None")
            return
        self._check_blocks()
        if not callable(self.model) and not isinstance(self.model, str):
            raise ValueError(f"TrainConfig.model={self.model!r}: pass 'mlp', 'gpt', a callable "
                             f"returning an nn.Module, or an import path 'package.module:make_model'")
        for name in ("data", "loss"):
            spec.resolve(getattr(self, name), name)  # an import path that fails, fails here
        info = self.info  # builds the model on the meta device once: no memory
        self.n_blocks = info.n_blocks
        if self.data is None and not info.causal_lm:
            raise ValueError(f"TrainConfig.data=None: {info.name} is not a Hugging Face causal "
                             f"LM, so ddpkit cannot make its data; pass data=make_data, a function "
                             f"(cfg) -> torch.utils.data.Dataset")

    def _check_blocks(self):
        """One path stays a string; several become a tuple of paths (hashable, plain data)."""
        if self.blocks is None:
            return
        if isinstance(self.blocks, (list, tuple)) and all(isinstance(b, str) for b in self.blocks):
            paths = tuple(self.blocks)
        elif isinstance(self.blocks, str):
            paths = paths_of(self.blocks)
        else:
            paths = ()
        if not paths:
            self._bad("blocks", "names no container of blocks",
                      "pass a dotted path ('transformer.h'), a list of them (['encoder.block', "
                      "'decoder.block']), or None to find every stack")
        self.blocks = paths[0] if len(paths) == 1 else paths

    @property
    def builtin(self):
        """Is the model one of the built-in teaching models?"""
        return isinstance(self.model, str) and self.model in MODELS

    @property
    def info(self):
        """`spec.ModelInfo` of the model (blocks, their count, what kind of model), from one
        build on the meta device (cached per factory)."""
        if self.builtin:  # one meta build per shape: what build_builtin reads
            shape = (self.n_blocks, self.width, self.mlp_ratio, self.seq_len, self.vocab,
                     self.n_heads, self.dropout)
            return spec.model_info(self.model, "blocks", build_key=shape,
                                   build=lambda: build_builtin(self.model, *shape))
        return spec.model_info(self.model, self.blocks, self.seed)

    @property
    def blocks_path(self):
        """Where the blocks are, as ``blocks=`` names them: 'blocks' in the built-in models, else
        the given or found path, or a tuple of paths where the model has several stacks."""
        return "blocks" if self.builtin else self.info.blocks

    def _stacks(self):
        """The blocks of each of the model's stacks, in order (what a setting is bound to)."""
        return (self.n_blocks,) if self.builtin else self.info.stack_sizes

    def _check_devices(self):
        # under torchrun the world spans machines: this machine runs only its own ranks
        here = local_share(self.world_size) if under_torchrun() else self.world_size
        backend, device = resolve_devices(here, self.backend, self.device)
        if self.precision == "fp16" and device != "cuda":
            raise ValueError("TrainConfig.precision='fp16' needs CUDA (GradScaler on CPU is a "
                             "no-op); on CPU pass precision='bf16' or 'fp32'")
        if self.memory_snapshot and device != "cuda":
            raise ValueError(f"TrainConfig.memory_snapshot={self.memory_snapshot!r}: the "
                             f"allocator history is CUDA's; this run is on {device}, where each "
                             f"probed step's peak_ledger says what the peak is made of: pass "
                             f"memory_snapshot=None")
        if self.precision == "bf16" and device == "cuda":
            check_bf16(here)
        if (self.link_gbps is not None or self.link_latency_us) and backend == "nccl":
            raise ValueError(f"TrainConfig.link_gbps={self.link_gbps!r}: the simulated link "
                             f"holds back gloo's all-reduce futures on the host; NCCL's complete "
                             f"when the kernel is queued, so it cannot slow them; pass "
                             f"link_gbps=None, link_latency_us=0, or backend='gloo'")
        if self.comm_hook == "bf16" and backend != "nccl":
            raise ValueError(f"TrainConfig.comm_hook='bf16': bf16_compress_hook needs CUDA and "
                             f"NCCL, this run uses {backend} (torch raises TypeError there); pass "
                             f"comm_hook='fp16' or None")

    # --- derived
    @property
    def probes(self):
        """The probes this config turns on."""
        return set(PROBES) if self.measure is True else set(self.measure or ())

    @property
    def global_batch(self):
        return self.world_size * self.micro_batch * self.accum_steps

    def rank_plan(self):
        """The `RankPlan` the ranks run: this config's fields, with what it derives worked out
        (where the blocks are, the checkpoint setting on the model's stacks, the probes)."""
        engine_reads = {f.name for f in dataclasses.fields(RankPlan)} - {
            "blocks", "checkpoint", "probes", "n_params", "config"}
        return RankPlan(**{name: getattr(self, name) for name in engine_reads},
                        blocks=self.blocks_path, checkpoint=self.checkpoint,
                        probes=frozenset(self.probes),
                        n_params=None if self.builtin else self.info.n_params, config=self)

    def replace(self, **changes):
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self):
        """Every field but ``extra``, as one writes them (the checkpoint's plain value): what
        ``TrainConfig(**d)`` builds again, and what JSON takes."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**d, "checkpoint": self.checkpoint.plain}

    def to_cli(self):
        """The ``python -m ddpkit train`` arguments that rebuild this config."""
        base = TrainConfig()
        args = []
        for name, value in self.to_dict().items():
            if name in ("world_size", "backend", "device") or value == getattr(base, name) or \
                    (name == "n_blocks" and not self.builtin):  # read from the model
                continue
            flag = "--" + name.replace("_", "-")
            if name in ("model", "data", "loss"):
                path = spec.import_path(value)
                if path is None:
                    raise ValueError(
                        f"TrainConfig.{name}={spec.describe_spec(value)} is defined in the "
                        f"notebook (__main__): the CLI and torchrun import it by path; move it "
                        f"into a module and pass {name}='package.module:{name}_function'")
                args += [flag, path]
            elif name == "measure":
                value = value if isinstance(value, bool) else ",".join(value)
                args += [flag, str(value).lower()]
            elif isinstance(value, bool):
                args.append(flag if value else "--no-" + name.replace("_", "-"))
            elif name == "blocks":  # several stacks: one comma list
                args += [flag, value if isinstance(value, str) else ",".join(value)]
            elif name == "checkpoint":  # the setting's one text form
                args += [flag, str(self.checkpoint)]
            else:
                args += [flag, str(value)]
        return args

    def to_torchrun(self, nproc_per_node=None, nnodes=1):
        """The command that runs this config on a cluster with torchrun."""
        nproc = nproc_per_node or self.world_size
        rdzv = "" if nnodes == 1 else " --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500"
        return (f"torchrun --nnodes {nnodes} --nproc-per-node {nproc}{rdzv} -m ddpkit train "
                + " ".join(shlex.quote(a) for a in self.to_cli())).rstrip()

    def to_slurm(self, nodes, gpus_per_node, *, nproc_per_node=None, time="01:00:00",
                 partition=None, account=None, job_name="ddpkit", port=29500, setup=None,
                 json="ddpkit-$SLURM_JOB_ID.json"):
        """An sbatch script that runs this config on ``nodes`` machines of a SLURM cluster, to
        submit as is (``sbatch job.sh``): one task per node, each ``srun torchrun`` starting that
        node's ranks (one per GPU; ``nproc_per_node`` on CPU nodes, ``gpus_per_node=0``), which
        meet through torchrun's c10d rendezvous on the allocation's first node at ``port``.
        ``setup``: shell lines run first (``"source .venv/bin/activate"``, ``module load``...);
        ``json``: where global rank 0 writes the run's records (None: nowhere)."""
        return sbatch_script(self.to_cli(), nodes, gpus_per_node, nproc_per_node=nproc_per_node,
                            time=time, partition=partition, account=account,
                            job_name=job_name, port=port, setup=setup, json=json)

