"""A user's own model, data and loss, importable by path (the CLI and torchrun take
``--model tests.fixtures_module:make_model``), and small transformers models from configs."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """A classifier with its blocks inside an nn.Sequential, called as a whole."""

    def __init__(self, width=32, n_blocks=4, classes=5):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.body = nn.Sequential(*(Block(width) for _ in range(n_blocks)))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.body(self.inp(x)))


def make_model():
    return Net()


def make_data(cfg):
    g = torch.Generator().manual_seed(123)
    x = torch.randn(256, 16, generator=g)
    y = (x[:, :5].argmax(dim=1))  # a learnable rule
    return torch.utils.data.TensorDataset(x, y)


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def make_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64,
                                      n_positions=32, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def make_wide_vocab_gpt2():
    """GPT-2 with its tied embedding (wte is lm_head's weight) large next to the rest: a
    gradient summed from two uses, the lm_head's a transposed view."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=2048,
                                      n_positions=16, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def make_lora_gpt2():
    """make_gpt2 with LoRA adapters (rank 4) on each block's attention and MLP: peft freezes
    the rest, embeddings included."""
    import warnings

    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():  # GPT-2's Conv1D: peft sets fan_in_fan_out itself
        warnings.simplefilter("ignore", UserWarning)
        return get_peft_model(make_gpt2(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["c_attn", "c_fc"]))


def make_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=64, max_position_embeddings=32,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def make_bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, vocab_size=64,
                                      max_position_embeddings=32, pad_token_id=0,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class Tokens(torch.utils.data.Dataset):
    """Token sequences as a masked LM takes them: {"input_ids", "labels"} (every position)."""

    def __init__(self, n, seq_len, vocab=64):
        self.ids = torch.randint(1, vocab, (n, seq_len), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_tokens(cfg):
    return Tokens(256, cfg.seq_len)
