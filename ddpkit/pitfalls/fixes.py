"""The fix for each hazard, said once: the catalogue (`Pitfall.fix`) and the doctor
(`Finding.fix`) both read it from here, so what the lab teaches and what the doctor tells you
about your own model cannot drift apart."""

REENTRANT = ("pass use_reentrant=False to checkpoint (the autograd graph is built normally), or "
             "static_graph=True to DDP (DDP learns from the first iteration which gradients come "
             "when)")
DEFAULT_USE_REENTRANT = "pass use_reentrant=False (or True) to every checkpoint call"
BATCHNORM_IN_CHECKPOINT = ("keep BatchNorm outside checkpointed segments (checkpoint the layers "
                           "around it), or use LayerNorm/GroupNorm there")
DROPOUT_RNG = "keep preserve_rng_state=True (the default) for segments with dropout"
UNUSED_PARAMETERS = ("pass find_unused_parameters=True to DDP (one graph traversal per step), or "
                     "delete or freeze (requires_grad_(False)) the unused parameters")
RANDOM_IN_RECOMPUTE = ("draw random decisions from torch's RNG (torch.rand; restored for the "
                       "recompute), or make them outside the checkpointed function and pass "
                       "them in")
SYNCBATCHNORM_CPU = ("convert_sync_batchnorm only when the ranks run on GPUs; on CPU keep plain "
                     "BatchNorm (each rank normalises with its own batch; DDP broadcasts rank "
                     "0's running statistics each forward), or use GroupNorm/LayerNorm")
LORA_REENTRANT = ("pass use_reentrant=False (the recompute's graph needs no input that requires "
                  "grad), or call model.enable_input_require_grads() before training (a hook "
                  "that makes the frozen embeddings' output require grad, as transformers' own "
                  "gradient_checkpointing_enable and peft's prepare_model_for_kbit_training do)")
