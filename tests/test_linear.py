import pytest
import torch

from redline.layers.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (3, 2), (2, 5), (4, 3)])  # leading dims: 1..12 rows
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_nn_linear(dtype, shape, bias):
    layer = Linear(96, 40, bias=bias).to(dtype)
    x = torch.randn(*shape, 96).to(dtype)
    expected = torch.nn.functional.linear(
        x.double(), layer.weight.double(), None if not bias else layer.bias.double()
    )
    # fp32: K = 96 products summed in a different order differ by a few ulp of the ~1.0 outputs;
    # bf16 (8-bit mantissa) rounds each output to ~4e-3 relative
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer(x).double(), expected, atol=tol, rtol=tol)
    assert layer(x).shape == (*shape, 40)
