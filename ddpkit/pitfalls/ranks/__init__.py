"""What each pitfall runs on its ranks: toy models and module-level rank functions, by family.

Module-level on purpose (ranks import them by name); small on purpose: a toy model of width 8,
a few steps, so a pitfall takes about a second. `ddpkit.pitfalls` names, runs and explains them.

`models.py` (the toy models; what every rank function shares) · `checkpointing.py` ·
`accumulation.py` · `faults.py` (uneven inputs, a crash, state_dict, unused parameters,
SyncBatchNorm, static_graph) · `hf.py` (a transformers GPT-2's own checkpointing; LoRA adapters
under reentrant checkpointing).
"""
from .accumulation import rank_accum_loop, rank_accumulate, rank_nosync_static
from .checkpointing import (rank_batchnorm, rank_default_reentrant, rank_dropout,
                            rank_input_no_grad, rank_recompute, rank_variants)
from .faults import (rank_exception, rank_state_dict, rank_static_branch, rank_syncbn,
                     rank_uneven, rank_unused)
from .hf import gpt2_tokens, hf_checkpointing, rank_hf, rank_lora, tiny_gpt2, tiny_lora_gpt2
from .models import (BNNet, BranchNet, CkptNet, DropNet, LayerDropNet, batch, build)

__all__ = ["BNNet", "BranchNet", "CkptNet", "DropNet", "LayerDropNet", "batch", "build",
           "gpt2_tokens", "hf_checkpointing", "rank_accum_loop", "rank_accumulate",
           "rank_batchnorm", "rank_default_reentrant", "rank_dropout", "rank_exception",
           "rank_hf", "rank_lora", "tiny_lora_gpt2", "rank_input_no_grad", "rank_nosync_static", "rank_recompute",
           "rank_state_dict", "rank_static_branch", "rank_syncbn", "rank_uneven", "rank_unused",
           "rank_variants", "tiny_gpt2"]
