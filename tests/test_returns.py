"""A rank's return value: pickled with its tensors' bytes beside the pickle, over a real pipe.
(The launch itself, a value read after its rank ended: test_launch.py.)"""
import multiprocessing
import threading

import pytest
import torch

from ddpkit.rank.returns import dumps_for_kernel, loads_from_rank, read_buffers, write_buffers


def over_a_pipe(value):
    """dumps in one thread, the bytes through a real Pipe (a socketpair), loads here."""
    a, b = multiprocessing.Pipe()
    with a, b:
        blob, buffers = dumps_for_kernel(value)
        sizes = [len(x) for x in buffers]
        writer = threading.Thread(target=write_buffers, args=(a, buffers))
        writer.start()  # more bytes than the socket holds: written while they are read
        got = read_buffers(b, sizes)
        writer.join()
    return loads_from_rank(blob, got), blob


def test_tensors_arrive_bitwise_with_their_dtype_shape_strides_and_sharing():
    w = torch.randn(1000, 300)  # 1.2 MB
    p = torch.nn.Parameter(torch.randn(5, 5))
    grad = torch.ones(3, requires_grad=True)
    value = {"w": w, "tied": w, "view": w[2::3, 1::2], "row": w[7], "empty": torch.zeros(0, 4),
             "bf16": torch.randn(17).bfloat16(), "i64": torch.arange(9), "bool": w[0] > 0,
             "p": p, "leaf": grad, "nonleaf": grad * 2, "nested": [(w[0], 3, "x")]}
    out, blob = over_a_pipe(value)
    assert len(blob) < 8192  # the tensors' bytes were not in the pickle
    for k in ("w", "view", "row", "empty", "bf16", "i64", "bool"):
        assert out[k].dtype == value[k].dtype and out[k].shape == value[k].shape
        assert out[k].stride() == value[k].stride() and torch.equal(out[k], value[k]), k
    assert out["tied"] is out["w"]
    storage = out["w"].untyped_storage().data_ptr()
    assert out["view"].untyped_storage().data_ptr() == storage  # one storage, sent once
    assert out["row"].storage_offset() == 7 * 300 and out["nested"][0][0].untyped_storage().data_ptr() == storage
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad
    assert torch.equal(out["p"], p) and out["leaf"].requires_grad and out["leaf"].is_leaf
    assert out["nonleaf"].requires_grad and out["nonleaf"].is_leaf  # as torch pickles one
    out["w"].add_(1)  # the kernel's tensors are its own, writable memory
    assert torch.equal(out["w"], w + 1)
    out["i64"].resize_(100)  # in torch's own allocations, resizable as any
    assert out["i64"][:9].tolist() == list(range(9))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_tensors_off_the_fast_path_are_pickled_by_torch():
    sparse = torch.eye(4).to_sparse()
    tagged = torch.arange(3.0)
    tagged.note = "kept"  # an attribute of its own
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])  # strided, yet no sizes
    out, _ = over_a_pipe({"sparse": sparse, "tagged": tagged, "nested": nested})
    assert out["sparse"].is_sparse and torch.equal(out["sparse"].to_dense(), torch.eye(4))
    assert out["nested"].is_nested and [t.tolist() for t in out["nested"].unbind()] == [[1.0] * 2, [1.0] * 3]
    assert out["tagged"].note == "kept" and torch.equal(out["tagged"], tagged)


def test_a_pipe_closed_mid_value_is_an_eof():
    a, b = multiprocessing.Pipe()
    with b:
        with a:
            write_buffers(a, [b"x" * 100])
        with pytest.raises(EOFError, match="100 bytes into a 1000-byte buffer"):
            read_buffers(b, [1000])
