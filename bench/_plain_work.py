"""The same tiny job for the baselines: plain mp.spawn and torchrun. Reports when its first record
would be ready (process group up, one all-reduce done) as a wall-clock timestamp."""
import os
import time

import torch
import torch.distributed as dist


def first_record(rank, world_size, port, queue=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        if queue is not None:
            queue.put(time.time())
        else:
            print(f"FIRST_RECORD {time.time()!r}", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort the interpreter at a normal exit (TORCH_NOTES): skip it


if __name__ == "__main__":  # under torchrun
    first_record(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_PORT"])
