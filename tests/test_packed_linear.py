"""Fast CPU linears: oneDNN-packed float weights, cached float copies of quantized layers, and W8A8."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.kernels import linear as seam
from tokenfab.model.layers import PackedLinear, pack_linears, packed_linear_supported, release_float_weights
from tokenfab.quant.linear import Int4Linear, Int8Linear, W8A8Linear

pytestmark = pytest.mark.skipif(not packed_linear_supported("cpu", torch.float32), reason="needs oneDNN on CPU")


def test_packed_linear_matches_nn_linear_for_any_token_count():
    torch.manual_seed(0)
    lin = nn.Linear(576, 960)
    packed = PackedLinear(lin)
    for rows in (1, 3, 32, 129):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert packed(torch.randn(2, 5, 576)).shape == (2, 5, 960)


def test_pack_linears_swaps_float_linears_and_keeps_a_tied_weight_readable():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.proj = nn.Linear(16, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight
            self.q = Int8Linear.from_float(torch.randn(16, 16))
    m = Tiny()
    x = torch.randn(4, 16)
    ref_proj, ref_head = m.proj(x), m.head(x)
    assert pack_linears(m) == 2
    assert isinstance(m.proj, PackedLinear) and isinstance(m.head, PackedLinear)
    assert isinstance(m.q, Int8Linear)                              # quantized layers are left alone
    m.proj(x), m.head(x)                                            # installs the default plans (oneDNN)
    assert release_float_weights(m) == 16 * 16 * 4
    assert m.head.weight is m.embed.weight                          # shared: stays
    assert m.proj.weight is None                                    # not shared: the packed copy replaces it
    torch.testing.assert_close(m.proj(x), ref_proj)
    torch.testing.assert_close(m.head(x), ref_head)


def test_select_kernels_drops_each_float_weight_as_its_oneDNN_plan_goes_in():
    """A float model's load holds one form of each weight at a time: when a layer's plan is installed,
    every layer planned before it has already given up its plain weight (tied ones keep theirs)."""
    from tokenfab.kernels.select import select_kernels
    from tokenfab.model.layers import float_weight_releaser
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)], nn.Embedding(10, 64), nn.Linear(64, 10, bias=False))
    m[5].weight = m[4].weight
    x = torch.randn(3, 64)
    refs = [m[i](x) for i in range(4)]
    pack_linears(m)
    release, planned, held = float_weight_releaser(m), [], []

    def after(layer):
        held.append(sum(p.weight is not None for p in planned if p is not m[5]))
        planned.append(layer)
        release(layer)

    select_kernels(m, max_rows=8, head_max_rows=8, autotune=False, head=m[5], after_plan=after)
    assert len(planned) == 5 and held == [0, 0, 0, 0, 0]
    assert m[5].weight is m[4].weight and all(m[i].weight is None for i in range(4))
    for i in range(4):
        torch.testing.assert_close(m[i](x), refs[i])


@pytest.mark.parametrize("make", [lambda w: Int8Linear.from_float(w), lambda w: Int4Linear.from_float(w, None, 32)],
                         ids=["int8", "int4"])
def test_float_copy_kernel_serves_any_batch_with_the_dequantized_weight(make):
    torch.manual_seed(0)
    q = make(torch.randn(256, 576) * 0.05)
    x = torch.randn(64, 576)
    ref = F.linear(x, q.dequantize())
    q.kernel = "float"
    torch.testing.assert_close(q(x), ref, rtol=1e-5, atol=1e-5)
    assert q.plan.float_copy_bytes() == 256 * 576 * 4               # counted in the engine's budget
    q.kernel = "dequant"
    assert q.plan.float_copy_bytes() == 0


def test_int8_packed_kernel_runs_weights_that_do_not_start_on_64_bytes():
    # a safetensors file maps its tensors at the header's offsets; _weight_int8pack_mm faulted on such
    # weights at 4 rows (SIGSEGV), so the packed plan takes an aligned copy
    if seam.get("packed").supports(Int8Linear.from_float(torch.randn(64, 64))) is not None:
        pytest.skip("torch has no _weight_int8pack_mm here")
    torch.manual_seed(0)
    src = Int8Linear.from_float(torch.randn(192, 64) * 0.05)
    raw = torch.empty(192 * 64 + 8, dtype=torch.int8)
    shifted = raw[8:].view(192, 64)
    shifted.copy_(src.qweight)
    q = Int8Linear(shifted, src.scales)
    assert q.qweight.data_ptr() % 64 != 0
    q.kernel = "packed"
    for rows in (1, 4, 17):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(q(x), F.linear(x, q.dequantize()), rtol=2e-2, atol=2e-2)
    assert q.qweight.data_ptr() % 64 == 0


# ------------------------------------------------------------------------------------------------ w8a8
w8a8_only = pytest.mark.skipif(seam.get("w8a8").supports(W8A8Linear.from_float(torch.randn(16, 32))) is not None,
                               reason="needs FBGEMM")


@w8a8_only
def test_w8a8_stays_close_to_float_per_token_even_with_an_outlier_row():
    torch.manual_seed(0)
    lin = nn.Linear(576, 960)
    q = W8A8Linear.from_float(lin.weight.data, lin.bias.data)
    x = torch.randn(8, 576)
    x[3] *= 1000                        # one loud token must not cost the others precision
    ref = lin(x)
    rel = (q(x) - ref).norm(dim=1) / ref.norm(dim=1)
    assert float(rel.max()) < 0.03, rel


@w8a8_only
def test_w8a8_gives_a_token_the_same_result_alone_or_in_any_batch():
    torch.manual_seed(1)
    q = W8A8Linear.from_float(torch.randn(384, 576) * 0.05)
    x = torch.randn(9, 576) * torch.logspace(-2, 2, 9)[:, None]
    batched = q(x)
    for i in range(9):
        assert torch.equal(q(x[i:i + 1]), batched[i:i + 1])
    assert torch.equal(q(x[2:7]), batched[2:7])


@w8a8_only
def test_w8a8_differs_from_weight_only_int8_by_activation_rounding_only():
    torch.manual_seed(2)
    q = W8A8Linear.from_float(torch.randn(256, 576) * 0.05)
    x = torch.randn(4, 576)
    y = q(x)
    q.kernel = "dequant"                # the weights-only reference path
    ref = q(x)
    assert not torch.equal(y, ref)
    torch.testing.assert_close(y, ref, rtol=0.05, atol=0.05 * float(ref.abs().max()))
