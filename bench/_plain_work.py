"""The same tiny job for the baselines: plain mp.spawn and torchrun. Reports when its first record
would be ready (process group up, one all-reduce done) as a wall-clock timestamp.

``device='cuda'`` puts the all-reduce on a GPU as ddpkit would: NCCL (with gloo for CPU tensors)
when each rank has its own GPU, gloo on shared GPUs otherwise."""
import os
import sys
import time

import torch
import torch.distributed as dist


def first_record(rank, world_size, port, queue=None, device="cpu", backend="gloo"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cpu")
    if device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    nccl = backend == "nccl"
    dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", rank=rank,
                            world_size=world_size, device_id=dev if nccl else None)
    dist.all_reduce(torch.ones(1, device=dev))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if rank == 0:
        if queue is not None:
            queue.put(time.time())
        else:
            print(f"FIRST_RECORD {time.time()!r}", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort the interpreter at a normal exit (TORCH_NOTES): skip it


if __name__ == "__main__":  # under torchrun: python _plain_work.py [device backend]
    first_record(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_PORT"],
                 None, *sys.argv[1:3])
