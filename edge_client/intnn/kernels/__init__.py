"""Numba kernels of the integer-only training step (ProWD appendix B / WAGE), by what they
compute: :mod:`.arith` (rounding shifts, exact ``round(log2)``), :mod:`.rng` (the
counter-based stochastic-rounding stream), :mod:`.layout` (NHWC / ``[K, K, C, O]``,
ternarization, im2col and planes), :mod:`.conv_forward`, :mod:`.conv_backward`,
:mod:`.linear`, :mod:`.pool` (max-pool, its error routed and quantized in one pass, ReLU),
:mod:`.loss` (SSE, integer softmax), :mod:`.update` (eq. 12, eq. 15-16), and :mod:`.vnni`
/ :mod:`.vnni_linear` (the same as int8 dot products on AVX-512 VNNI where the CPU has it,
:data:`VNNI`; bit-identical). This package re-exports every kernel.

Every kernel takes and returns integers (or booleans) only (``tests/packages/edge_client/test_intnn_integer_only.py``
inspects the type maps of :data:`TRAINING_KERNELS`). Widths: activations and quantized
errors ``int8`` (s <= 8) or ``int16``; ternary weights ``int8``; stored weights
``int8``/``int16``; raw errors and forward accumulators ``int32``; weight gradients
``int32`` when ``amax^2 * pixels`` fits, else ``int64``.
"""

from edge_client.intnn.kernels import vnni, vnni_linear
from edge_client.intnn.kernels.arith import LOG2_HALF_THRESH, max_abs, round_log2, round_shift
from edge_client.intnn.kernels.conv_backward import (
    conv_backward_data,
    conv_backward_data_narrow,
    conv_weight_grad,
    conv_weight_grad_dot,
    conv_weight_grad_plane,
    conv_weight_grad_sparse,
    eq_to_planar,
    pad_nhwc,
)
from edge_client.intnn.kernels.conv_forward import (
    conv_forward,
    conv_forward_col,
    conv_forward_plane,
)
from edge_client.intnn.kernels.layout import (
    quantize_inputs_nhwc,
    ternarize,
    ternary_copies,
    ternary_lists,
    transpose_kkco_okkc,
)
from edge_client.intnn.kernels.linear import (
    linear_backward_data,
    linear_forward,
    linear_weight_grad,
)
from edge_client.intnn.kernels.loss import SOFTMAX_ONE, argmax_correct, softmax_error, sse_error
from edge_client.intnn.kernels.pool import (
    maxpool_backward,
    maxpool_forward,
    pool_error_quantize,
    pool_error_route,
    pool_error_scale,
    relu_forward,
    relu_mask,
)
from edge_client.intnn.kernels.rng import mix64, rand62, stream_key
from edge_client.intnn.kernels.update import (
    grad_max,
    mask_quantize_error,
    quantize_error,
    regularizer_terms,
    sgd_update,
)
from edge_client.intnn.kernels.vnni import AVAILABLE as VNNI
from edge_client.intnn.kernels.vnni import (
    conv_backward_data_vnni,
    conv_forward_vnni,
    conv_weight_grad_plane_vnni,
    conv_weight_grad_sparse_vnni,
    pad_rows,
    plane_for_grad,
)
from edge_client.intnn.kernels.vnni_linear import (
    linear_backward_data_vnni,
    linear_forward_vnni,
    linear_grad_max_vnni,
    linear_update_vnni,
    linear_weight_grad_vnni,
)

# The kernels a training step runs from Python (their compiled signatures must be
# integer-only). The jitted helpers they call are all inline="always": their bodies are
# typed inside these kernels.
TRAINING_KERNELS = (
    conv_forward, conv_forward_col, linear_forward, maxpool_forward, relu_forward,
    sse_error, softmax_error, relu_mask, quantize_error, mask_quantize_error,
    conv_backward_data, conv_weight_grad, conv_weight_grad_dot, linear_backward_data,
    linear_weight_grad, maxpool_backward, pool_error_scale, pool_error_route,
    sgd_update, regularizer_terms,
    ternarize, ternary_copies, argmax_correct, stream_key, conv_forward_plane,
    conv_weight_grad_plane, conv_weight_grad_sparse, conv_backward_data_narrow, eq_to_planar,
    pad_nhwc, grad_max,
) + ((conv_backward_data_vnni, conv_forward_vnni, conv_weight_grad_plane_vnni,
      conv_weight_grad_sparse_vnni, linear_backward_data_vnni, linear_forward_vnni,
      linear_grad_max_vnni, linear_update_vnni, linear_weight_grad_vnni, pad_rows,
      plane_for_grad) if VNNI else ())

__all__ = [
    "LOG2_HALF_THRESH", "SOFTMAX_ONE", "TRAINING_KERNELS", "VNNI", "argmax_correct",
    "conv_backward_data", "conv_backward_data_narrow", "conv_backward_data_vnni",
    "conv_forward", "conv_forward_col", "conv_forward_plane", "conv_forward_vnni",
    "conv_weight_grad", "conv_weight_grad_dot", "conv_weight_grad_plane",
    "conv_weight_grad_plane_vnni", "conv_weight_grad_sparse", "conv_weight_grad_sparse_vnni",
    "eq_to_planar", "grad_max", "linear_backward_data", "linear_backward_data_vnni",
    "linear_forward", "linear_forward_vnni", "linear_grad_max_vnni", "linear_update_vnni", "linear_weight_grad",
    "linear_weight_grad_vnni", "mask_quantize_error", "max_abs", "maxpool_backward",
    "maxpool_forward", "mix64", "pad_nhwc", "pad_rows", "plane_for_grad",
    "pool_error_quantize", "pool_error_route", "pool_error_scale", "quantize_error",
    "quantize_inputs_nhwc", "rand62", "regularizer_terms", "relu_forward", "relu_mask",
    "round_log2", "round_shift", "sgd_update", "softmax_error", "sse_error", "stream_key",
    "ternarize", "ternary_copies", "ternary_lists", "transpose_kkco_okkc", "vnni",
    "vnni_linear",
]
