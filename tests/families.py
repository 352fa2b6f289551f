"""transformers families built from tiny configs (nothing downloaded), each with its data: what
the breadth test (tests/test_breadth.py) and `python -m bench.breadth` train, estimate and plan.

Every config has dropout 0 (the estimate does not count dropout masks) and no layer drop (it
skips blocks at random). A family is `Family(make, data, loss, blocks)`: ``blocks`` is what
``blocks=None`` must find, ``skip`` (when set) why the family cannot pass.
"""
from dataclasses import dataclass

import torch

V, T = 64, 8  # vocabulary and tokens of every text model


@dataclass(frozen=True)
class Family:
    kind: str
    make: object
    data: object = None
    loss: object = None
    blocks: object = None
    skip: str = ""


class Samples(torch.utils.data.Dataset):
    """A dict of per-sample tensors, made once from a seeded generator."""

    def __init__(self, **tensors):
        self.tensors = tensors

    def __len__(self):
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.tensors.items()}


def _g():
    return torch.Generator().manual_seed(7)


def tokens(cfg, n=64):
    ids = torch.randint(1, V, (n, T), generator=_g())
    return Samples(input_ids=ids, labels=ids)


def pairs(cfg, n=64):
    g = _g()
    return Samples(input_ids=torch.randint(1, V, (n, T), generator=g),
                   labels=torch.randint(1, V, (n, T), generator=g))


def images(cfg, n=64):
    g = _g()
    return Samples(pixel_values=torch.randn(n, 3, 16, 16, generator=g),
                   labels=torch.randint(0, 5, (n,), generator=g))


def audio_features(cfg, n=64):  # Whisper: log-mel frames (mel bins x 2 * max_source_positions)
    g = _g()
    return Samples(input_features=torch.randn(n, 8, 16, generator=g),
                   labels=torch.randint(1, V, (n, T), generator=g))


def waveforms(cfg, n=64):  # Wav2Vec2: raw samples, one class per clip
    g = _g()
    return Samples(input_values=torch.randn(n, 400, generator=g),
                   labels=torch.randint(0, 5, (n,), generator=g))


def transcribed(cfg, n=64):  # Wav2Vec2 for CTC: raw samples, 4 characters each
    g = _g()
    return Samples(input_values=torch.randn(n, 400, generator=g),
                   labels=torch.randint(1, 20, (n, 4), generator=g))


def text_and_images(cfg, n=64):
    g = _g()
    return Samples(input_ids=torch.randint(1, V, (n, T), generator=g),
                   pixel_values=torch.randn(n, 3, 16, 16, generator=g))


def clip_loss(model, batch):
    return model(**batch, return_loss=True).loss


# --- the models: 2 blocks per stack, width 32
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=T,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=V, max_position_embeddings=T, bos_token_id=0,
                                        eos_token_id=0, pad_token_id=0))


def opt():
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64,
                                    num_attention_heads=4, vocab_size=V, max_position_embeddings=T,
                                    word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                                    layerdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def bert():
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, vocab_size=V,
                                      max_position_embeddings=T, pad_token_id=0,
                                      hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def distilbert():
    from transformers import DistilBertConfig, DistilBertForMaskedLM
    return DistilBertForMaskedLM(DistilBertConfig(n_layers=2, dim=32, hidden_dim=64, n_heads=4,
                                                  vocab_size=V, max_position_embeddings=T,
                                                  pad_token_id=0, dropout=0.0,
                                                  attention_dropout=0.0))


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(num_layers=2, num_decoder_layers=2, d_model=32,
                                               d_ff=64, d_kv=8, num_heads=4, vocab_size=V,
                                               dropout_rate=0.0, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))


def bart():
    from transformers import BartConfig, BartForConditionalGeneration
    return BartForConditionalGeneration(BartConfig(
        encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=V,
        max_position_embeddings=T, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=0, bos_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=None))


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(num_hidden_layers=2, hidden_size=32,
                                               intermediate_size=64, num_attention_heads=4,
                                               image_size=16, patch_size=4, num_labels=5,
                                               hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0))


def convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification
    return ConvNextForImageClassification(ConvNextConfig(num_stages=2, hidden_sizes=[16, 32],
                                                         depths=[1, 1], image_size=16,
                                                         patch_size=2, num_labels=5,
                                                         drop_path_rate=0.0))


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    return WhisperForConditionalGeneration(WhisperConfig(
        encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=4, decoder_attention_heads=4, num_mel_bins=8, vocab_size=V,
        max_source_positions=8, max_target_positions=T, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=0,
        bos_token_id=0, eos_token_id=1, decoder_start_token_id=0, begin_suppress_tokens=None,
        suppress_tokens=None))


def _wav2vec2_config():
    from transformers import Wav2Vec2Config
    return Wav2Vec2Config(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, vocab_size=20, hidden_dropout=0.0, activation_dropout=0.0,
        attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0, pad_token_id=0, ctc_loss_reduction="mean", num_labels=5,
        classifier_proj_size=16)


def wav2vec2():
    from transformers import Wav2Vec2ForSequenceClassification
    return Wav2Vec2ForSequenceClassification(_wav2vec2_config())


def wav2vec2_ctc():
    from transformers import Wav2Vec2ForCTC
    return Wav2Vec2ForCTC(_wav2vec2_config())


def ctc_loss(model, batch):
    """CTC on the logits with every length fixed (Python ints): no tensor value is read."""
    logits = model(input_values=batch["input_values"]).logits
    n, frames, labels = logits.shape[0], logits.shape[1], batch["labels"].shape[1]
    return torch.nn.functional.ctc_loss(logits.log_softmax(-1).transpose(0, 1), batch["labels"],
                                        (frames,) * n, (labels,) * n, blank=0)


def clip():
    from transformers import CLIPConfig, CLIPModel
    text = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                vocab_size=V, max_position_embeddings=T, attention_dropout=0.0, pad_token_id=0,
                bos_token_id=0, eos_token_id=1)
    vision = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  image_size=16, patch_size=4, attention_dropout=0.0)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


def albert():
    from transformers import AlbertConfig, AlbertForMaskedLM
    return AlbertForMaskedLM(AlbertConfig(num_hidden_layers=2, hidden_size=32, embedding_size=16,
                                          intermediate_size=64, num_attention_heads=4,
                                          vocab_size=V, max_position_embeddings=T,
                                          hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0, pad_token_id=0))


def mixtral(experts="grouped_mm", routed=False):
    """Mixtral (mixture of experts: 4 experts, top-2, the router's auxiliary loss on).
    ``experts``: transformers' experts implementation ('grouped_mm', its default; 'eager': a
    loop over the experts hit, with data-dependent ops); ``routed``: `round_robin` routers."""
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                           max_position_embeddings=T, num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.01,
                           bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._experts_implementation = experts
    return round_robin(MixtralForCausalLM(config)) if routed else MixtralForCausalLM(config)


def qwen3_moe(experts="grouped_mm", routed=False):
    """Qwen3-MoE (4 experts of width 32, top-2, every layer sparse, auxiliary loss on)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                            moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, vocab_size=V, max_position_embeddings=T, num_experts=4,
                            num_experts_per_tok=2, output_router_logits=True,
                            router_aux_loss_coef=0.01, decoder_sparse_step=1, mlp_only_layers=[],
                            bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._experts_implementation = experts
    return round_robin(Qwen3MoeForCausalLM(config)) if routed else Qwen3MoeForCausalLM(config)


def round_robin(model):
    """A test hook: every router of ``model`` routes round-robin, token r to experts
    (r*k + j) % E for j < k (each expert gets tokens*k/E: balanced routing, forced), its
    weights the router's own probabilities there. What ddpkit's routing='balanced' assumes."""
    def route(router, args, out):
        logits, scores, indices = out
        rows, k = indices.shape
        r = torch.arange(rows, device=indices.device).unsqueeze(1)
        chosen = (r * k + torch.arange(k, device=indices.device)) % router.num_experts
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
        return logits, (probs / probs.sum(-1, keepdim=True)).to(scores.dtype), chosen
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.register_forward_hook(route)
    return model


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          vocab_size=V, max_position_embeddings=T, sliding_window=4,
                                          attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                                          pad_token_id=0))


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(num_hidden_layers=2, hidden_size=32,
                                            intermediate_size=64, num_attention_heads=4,
                                            vocab_size=V, max_position_embeddings=T,
                                            attention_dropout=0.0, hidden_dropout=0.0,
                                            bos_token_id=0, eos_token_id=0))


def mamba():
    """Mamba on its reference path (a Python scan: no CUDA kernels on CPU)."""
    from transformers import MambaConfig, MambaForCausalLM
    return MambaForCausalLM(MambaConfig(num_hidden_layers=2, hidden_size=32, state_size=8,
                                        expand=2, conv_kernel=4, vocab_size=V,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                        use_cache=False))


def deberta_v2():
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification
    return DebertaV2ForSequenceClassification(DebertaV2Config(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        vocab_size=V, max_position_embeddings=T, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0))


def classes(cfg, n=64):  # one label per sequence
    g = _g()
    return Samples(input_ids=torch.randint(1, V, (n, T), generator=g),
                   labels=torch.randint(0, 3, (n,), generator=g))


FAMILIES = {
    "gpt2": Family("decoder-only", gpt2, blocks="transformer.h"),
    "llama": Family("decoder-only", llama, blocks="model.layers"),
    "opt": Family("decoder-only", opt, blocks="model.decoder.layers"),
    "bert": Family("encoder-only", bert, tokens, blocks="bert.encoder.layer"),
    "distilbert": Family("encoder-only", distilbert, tokens, blocks="distilbert.transformer.layer"),
    "t5": Family("encoder-decoder", t5, pairs, blocks=("encoder.block", "decoder.block")),
    "bart": Family("encoder-decoder", bart, pairs,
                   blocks=("model.encoder.layers", "model.decoder.layers")),
    "vit": Family("vision", vit, images, blocks="vit.layers"),
    "convnext": Family("vision", convnext, images, blocks="convnext.encoder.stages"),
    "whisper": Family("speech", whisper, audio_features,
                      blocks=("model.encoder.layers", "model.decoder.layers")),
    "wav2vec2": Family("speech", wav2vec2, waveforms, blocks="wav2vec2.encoder.layers"),
    "wav2vec2-ctc": Family("speech", wav2vec2_ctc, transcribed, ctc_loss,
                           blocks="wav2vec2.encoder.layers", skip=(
        "CTC's loss (aten._ctc_loss) makes an output whose size depends on the target lengths' "
        "values, and Wav2Vec2ForCTC's own loss reads labels.max(): fake tensors have neither, so "
        "its step cannot be traced or simulated (ddpkit.train runs it; the same encoder with a "
        "classification head, 'wav2vec2', passes)")),
    "clip": Family("two-tower", clip, text_and_images, clip_loss,
                   blocks=("text_model.encoder.layers", "vision_model.encoder.layers")),
    "gemma2": Family("decoder-only", gemma2, blocks="model.layers"),
    "gpt-neox": Family("decoder-only", gpt_neox, blocks="gpt_neox.layers"),
    "mamba": Family("state space", mamba, blocks="backbone.layers"),
    "mixtral": Family("mixture of experts", mixtral, blocks="model.layers"),
    "qwen3-moe": Family("mixture of experts", qwen3_moe, blocks="model.layers"),
    "deberta-v2": Family("encoder-only", deberta_v2, classes, blocks="deberta.encoder.layer"),
    "albert": Family("encoder-only", albert, tokens, skip=(
        "ALBERT shares one layer's weights across its depth (one AlbertLayer called "
        "num_hidden_layers times): there is no stack of distinct blocks to checkpoint or shard")),
}


# --- one family through the kit: what the breadth test asserts and bench.breadth tabulates
RUN = dict(world_size=2, micro_batch=4, accum_steps=1, steps=2, seq_len=T, optimizer="sgd",
           backend="gloo", device="cpu")


def config(name, **changes):
    fam = FAMILIES[name]
    import ddpkit

    return ddpkit.TrainConfig(**{"model": fam.make, "data": fam.data, "loss": fam.loss, **RUN,
                                 **changes})


def measure(name, pool=None):
    """Train ``name`` on 2 gloo ranks with checkpointing none and full; estimate both; plan it
    for the lowest peak checkpointing reaches. Returns the figures, asserting nothing."""
    import time

    import ddpkit
    from ddpkit.spec.model import build_model

    t0 = time.perf_counter()
    cfg = config(name)
    out = dict(family=name, kind=FAMILIES[name].kind, blocks=cfg.info.blocks,
               stacks=cfg.info.stack_sizes, n_blocks=cfg.n_blocks)
    weights = {}
    for setting in (None, "full"):
        run = cfg.replace(checkpoint=setting)
        res = ddpkit.train(run, pool=pool)
        weights[setting] = res.state_dict
        est = ddpkit.estimate(run)
        key = "none" if setting is None else setting
        out[f"measured_{key}"] = res.summary()["activation_bytes"]
        out[f"estimated_{key}"] = est.activations
        out[f"peak_{key}"] = est.peak().bytes
        out[f"policy_{key}"] = run.checkpoint.label()
    start = build_model(cfg.rank_plan())[0].state_dict()

    def diff(a, b):
        return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    out["weight_diff"] = diff(weights[None], weights["full"])
    out["trained"] = diff(weights[None], start)
    budget = min(out["peak_none"], out["peak_full"])  # as low as checkpointing can bring it
    p = ddpkit.plan(cfg, budget, allowance=0)  # the simulated peaks' own edge
    out.update(budget=budget, plan_fits=p.fits, plan_checkpoint=p.checkpoint,
               plan_peak=p.choice.total if p.fits else None)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out
