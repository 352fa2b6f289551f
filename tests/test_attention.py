"""What each SDPA kernel saves for backward (`ddpkit.predict.attention`), checked on CPU: the
CUDA kernels' rows against their aten ops run on meta tensors (the meta functions of
torch/_meta_registrations.py give the shapes, the ops' autograd formulas what is saved); the
CPU row against a real CPU run; the trace's stand-in against torch's own SDPA; and the estimate
of a CUDA run, formula and trace, against each other."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import ddpkit
from ddpkit import devices
from ddpkit.spec.setting import CheckpointSetting
from ddpkit.predict import attention as A
from ddpkit.predict.estimate import activation_bytes, estimate, trace_activations

SM80, H200 = A.CudaTarget((8, 0)), A.CudaTarget((9, 0), cudnn=91600, cuda="12.8")


def gpt_qkv(B, L, H, E, dtype=torch.float32, device="meta", grad=True):
    """q, k, v as the built-in GPT makes them: views of one (B, L, 3*H*E) projection."""
    x = torch.empty(B, L, 3 * H * E, dtype=dtype, device=device, requires_grad=grad)
    return x, x.view(B, L, 3, H, E).permute(2, 0, 3, 1, 4)


def kept_beyond(fn, *callers):
    """Bytes of the storages autograd keeps while ``fn()`` runs, except the callers' own."""
    mine = {t.untyped_storage()._cdata for t in callers if t is not None}
    seen = {}

    def pack(t):
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for key, n in seen.items() if key not in mine)


def test_the_default_order_is_torchs():
    assert tuple(SDPBackend(i).name for i in torch._C._get_sdp_priority_order()[:4]) == \
        ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION")
    assert A.DEFAULT_ORDER == ("flash", "efficient", "math", "cudnn")


# --- each CUDA row against the op's meta function and autograd formula
SHAPES = [(2, 40, 4, 8), (1, 33, 2, 16), (3, 64, 8, 64), (2, 7, 3, 12)]


@pytest.mark.parametrize("B, L, H, E", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_efficient_saves_what_its_meta_function_and_formula_say(B, L, H, E, causal):
    x, (q, k, v) = gpt_qkv(B, L, H, E)
    op = torch.ops.aten._scaled_dot_product_efficient_attention
    measured = kept_beyond(lambda: op(q, k, v, None, True, 0.0, causal), x)
    assert measured == A.saved_bytes("efficient", q, k, v)
    rounded = B * H * math.ceil(L / 32) * 32 * 4  # the log-sum-exp, rounded up to 32 queries
    assert measured == B * H * L * E * 4 + rounded + 16


@pytest.mark.parametrize("B, L, H, E", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_saves_what_its_meta_function_and_formula_say(B, L, H, E, dtype):
    x, (q, k, v) = gpt_qkv(B, L, H, E, dtype)

    def sdpa():  # attention.cpp pads the head dim to a multiple of 8 before the kernel
        pad = (0, -E % 8)
        qp, kp, vp = (F.pad(t, pad) if pad[1] else t for t in (q, k, v))
        torch.ops.aten._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, True)
    assert kept_beyond(sdpa, x) == A.saved_bytes("flash", q, k, v)


@pytest.mark.parametrize("B, L, H, E", SHAPES)
def test_cudnn_saves_what_its_meta_function_and_formula_say(B, L, H, E):
    x, (q, k, v) = gpt_qkv(B, L, H, E, torch.bfloat16)
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    assert kept_beyond(lambda: op(q, k, v, None, True, 0.0, True), x) == \
        A.saved_bytes("cudnn", q, k, v)


@pytest.mark.parametrize("S, boolean", [(40, False), (36, False), (36, True)])
def test_the_efficient_kernel_keeps_its_mask_made_float_and_padded(S, boolean):
    L, B, H, E = 20, 2, 4, 8
    q, k, v = (torch.empty(B, H, n, E, device="meta", requires_grad=True) for n in (L, S, S))
    mask = torch.empty(L, S, dtype=torch.bool if boolean else torch.float32, device="meta")

    def sdpa():  # as attention.cpp prepares it: float, then padded where unaligned, expanded
        bias = torch.empty(L, S, device="meta") if boolean else mask
        if S % 8:
            bias = F.pad(bias, (0, 8 - S % 8))[..., :S]
        torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias.expand(B, H, L, S), True, 0.0, False)
    assert kept_beyond(sdpa, q, k, v, mask) == A.saved_bytes("efficient", q, k, v,
                                                              attn_mask=mask)


@pytest.mark.parametrize("B, L, H, E", SHAPES)
def test_the_cpu_row_is_what_a_cpu_run_keeps(B, L, H, E):
    x, (q, k, v) = gpt_qkv(B, L, H, E, device="cpu")
    measured = kept_beyond(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), x)
    assert measured == A.saved_bytes("cpu_flash", q, k, v)


# --- the choice, row by row as sdp_utils.cpp reads (priority, then each kernel's constraints)
@pytest.mark.parametrize("target, dtype, E, kw, want", [
    (SM80, torch.float32, 8, {}, "efficient"),            # flash and cuDNN need fp16/bf16
    (SM80, torch.bfloat16, 8, {}, "flash"),               # flash first in torch's order
    (H200, torch.bfloat16, 64, {}, "cudnn"),              # sm90, cuDNN > 9.15: cuDNN first
    (H200, torch.float32, 64, {}, "efficient"),
    (A.CudaTarget((9, 0), cudnn=91500), torch.bfloat16, 64, {}, "flash"),  # cuDNN 9.15.0: not yet
    (A.CudaTarget((8, 6)), torch.bfloat16, 8, {}, "flash"),
    (SM80, torch.float32, 10, {}, "math"),                # 10 % 4: no efficient kernel
    (SM80, torch.float32, 6, {}, "math"),
    (SM80, torch.bfloat16, 12, {}, "flash"),              # flash pads 12 to 16 itself
    (A.CudaTarget((7, 5)), torch.float16, 8, {}, "efficient"),  # T4: no flash below sm80
    (A.CudaTarget((7, 5)), torch.bfloat16, 8, {}, "math"),
    (A.CudaTarget((6, 0)), torch.float32, 6, {}, "efficient"),  # alignment 1 below sm75 tensor cores
    (SM80, torch.bfloat16, 8, dict(dropout_p=0.1), "flash"),
    (H200, torch.bfloat16, 64, dict(dropout_p=0.1), "flash"),  # cuDNN: dropout in 1/16 steps
    (H200, torch.bfloat16, 64, dict(dropout_p=0.125), "cudnn"),
    (SM80, torch.bfloat16, 8, dict(enabled=frozenset({"efficient", "math"})), "efficient"),
])
def test_cuda_picks_the_kernel_sdp_utils_says(target, dtype, E, kw, want):
    enabled = kw.pop("enabled", None)
    if enabled:
        target = A.CudaTarget(target.capability, target.cudnn, target.cuda, enabled)
    _, (q, k, v) = gpt_qkv(2, 32, 4, E, dtype)
    assert A.cuda_kernel(q, k, v, target, is_causal=True, **kw) == want


def test_a_misaligned_k_offset_or_a_mask_rule_kernels_out():
    _, (q, k, v) = gpt_qkv(2, 32, 3, 4)  # D = 12: k starts 12 floats in, 12 % 4 == 0
    assert A.cuda_kernel(q, k, v, SM80) == "efficient"
    x = torch.empty(2, 32, 3 * 3 * 4 + 2, device="meta")[..., 2:]  # every offset 2 floats off
    q, k, v = x.unflatten(-1, (3, 3, 4)).permute(2, 0, 3, 1, 4)
    assert "storage offsets" in A.why_not("efficient", q, k, v, SM80)
    _, (q, k, v) = gpt_qkv(2, 32, 4, 8, torch.bfloat16)
    mask = torch.empty(32, 32, dtype=torch.bool, device="meta")
    assert A.why_not("flash", q, k, v, SM80, attn_mask=mask) == "flash takes no attn_mask"
    assert A.cuda_kernel(q, k, v, SM80, attn_mask=mask) == "efficient"
    short_q = q[:, :, :8]
    assert "as many queries as keys" in A.why_not("flash", short_q, k, v, SM80, is_causal=True)


# --- the trace's stand-in: torch's values, the CUDA kernel's layout and saved tensors
@pytest.mark.parametrize("target, dtype, E", [(SM80, torch.float32, 8), (SM80, torch.bfloat16, 8),
                                              (SM80, torch.bfloat16, 12), (H200, torch.bfloat16, 16),
                                              (SM80, torch.float32, 10)])
def test_the_stand_in_gives_torchs_values_and_keeps_the_kernels_tensors(target, dtype, E):
    torch.manual_seed(0)
    x, (q, k, v) = gpt_qkv(2, 40, 4, E, dtype, device="cpu")
    x.data.normal_()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want_grad, = torch.autograd.grad(want.square().sum(), x)
    with A.on_cuda(target) as mode:
        kept = kept_beyond(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad, = torch.autograd.grad(got.square().sum(), x)
    assert torch.allclose(grad, want_grad, atol=1e-2, rtol=1e-2)
    kernel = mode.kernels[0]
    # the stand-in's values are torch's SDPA's own; math is torch's composite (rounds its way)
    assert torch.equal(got, want) if kernel != "math" else torch.allclose(got, want, atol=1e-5)
    if kernel == "math":  # the composite keeps more
        assert kept > x.untyped_storage().nbytes() + A.saved_bytes("cpu_flash", q, k, v)
        return
    padded = kernel == "flash" and E % 8
    assert kept == (0 if padded else x.untyped_storage().nbytes()) + A.saved_bytes(kernel, q, k, v)
    # laid out as the kernel lays it out: (B, L, H, E) in memory, so merging heads is a view
    assert got.transpose(1, 2).is_contiguous() != bool(padded)


# --- the estimate of a CUDA run: formula and trace agree; what differs from CPU, and why
@pytest.fixture
def gpus(monkeypatch):
    def use(n, capability=(8, 0)):
        monkeypatch.setattr(devices, "cuda_gpus", lambda: [capability] * n)
    yield use


@pytest.mark.parametrize("seq_len", [32, 40])
def test_a_cuda_runs_estimate_counts_the_efficient_kernels_extra_bytes(gpus, seq_len):
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=4, width=32, seq_len=seq_len, micro_batch=3)
    setting = cfg.checkpoint.with_value
    on_cpu = {s: activation_bytes(cfg, setting(s)) for s in (None, 2, "full")}
    gpus(1)  # 2 ranks share one GPU (the notebook host): CUDA, efficient kernel in fp32
    B, H = cfg.micro_batch, cfg.n_heads
    per_block = 16 + B * H * (math.ceil(seq_len / 32) * 32 - seq_len) * 4
    for s, plain_blocks in ((None, 4), (2, 2), ("full", 0)):
        formula, traced = activation_bytes(cfg, setting(s)), trace_activations(cfg, setting(s))
        assert formula == traced == on_cpu[s] + plain_blocks * per_block, s
    assert estimate(cfg).method == "formula"


def test_where_cuda_runs_math_the_estimate_traces(gpus):
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=2, width=40, n_heads=4, seq_len=16)  # E = 10
    on_cpu = estimate(cfg)
    gpus(2)
    on_gpu = estimate(cfg)
    assert (on_cpu.method, on_gpu.method) == ("formula", "traced")
    assert on_gpu.activations > on_cpu.activations  # math keeps the attention matrix
    with pytest.raises(ValueError, match="math kernel.*estimate\\(cfg\\) traces"):
        from ddpkit.predict.estimate import activation_parts
        activation_parts(cfg)
