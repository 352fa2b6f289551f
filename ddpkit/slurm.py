"""The sbatch script `TrainConfig.to_slurm` writes: one ``srun torchrun`` per node, each
starting that node's ranks, meeting through torchrun's c10d rendezvous on the first node."""
from __future__ import annotations

import shlex


def sbatch_script(cli, nodes, gpus_per_node, nproc_per_node, time, partition, account, job_name,
                  port, setup, json):
    """`TrainConfig.to_slurm`'s script; each argument checked, naming the fix."""
    def bad(name, value, fix):
        raise ValueError(f"to_slurm({name}={value!r}): {fix}")

    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name == "nodes"):
            bad(name, value, f"pass a whole number{' >= 1' if name == 'nodes' else ' (0: CPU nodes)'}")
    if nproc_per_node is None:
        if gpus_per_node == 0:
            bad("nproc_per_node", None, "CPU nodes (gpus_per_node=0) need the ranks per node: "
                                        "pass nproc_per_node=2 or more")
        nproc_per_node = gpus_per_node
    elif isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or \
            nproc_per_node < 1 or (gpus_per_node and nproc_per_node > gpus_per_node):
        bad("nproc_per_node", nproc_per_node, "pass 1 or more ranks per node, at most "
                                              "gpus_per_node (NCCL runs one process per GPU)")
    if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
        bad("port", port, "pass a free TCP port in 1024..65535 on the first node")
    for name, value in (("time", time), ("partition", partition), ("account", account),
                        ("job_name", job_name)):
        if value is not None and (not isinstance(value, str) or not value
                                  or any(c.isspace() or c in "'\"$`\\" for c in value)):
            bad(name, value, "an #SBATCH value takes no spaces or quotes: pass e.g. "
                             "time='02:00:00', partition='gpu', job_name='ddpkit-gpt'")
    lines = ["#!/bin/bash",
             f"# ddpkit train on {nodes} node(s) x {nproc_per_node} rank(s): "
             f"{nodes * nproc_per_node} ranks. Made by TrainConfig.to_slurm(); submit: sbatch <file>",
             f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1",  # one torchrun per node; it starts the node's ranks
             f"#SBATCH --time={time}", f"#SBATCH --output={job_name}-%j.out"]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += [f"#SBATCH --{k}={v}" for k, v in (("partition", partition), ("account", account)) if v]
    # the set-up first: `module load` and some activate scripts read unset variables
    lines += [*([setup] if setup else []), "set -euo pipefail",
              "# torchrun's c10d rendezvous listens on the allocation's first node (sed reads",
              "# every line: `head -n 1` may close the pipe early, and pipefail then ends the job)",
              'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)']
    train = " ".join(shlex.quote(a) for a in cli) + (f' --json "{json}"' if json else "")
    lines.append(f'srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {nproc_per_node} '
                 f'--rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head:{port}" '
                 f"\\\n    -m ddpkit train {train}".rstrip())
    return "\n".join(lines) + "\n"
