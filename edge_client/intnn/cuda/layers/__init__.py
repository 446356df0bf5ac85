"""The CUDA engine's layers: one module per layer kind (the ``firmware_models.layers``
module's name), each registering its class with ``implements(<SpecType>, backend="cuda")``
and holding its kind's kernels. A class runs its kind for D devices at once: it launches
its kernels on a :class:`~edge_client.intnn.cuda.stack.Stack` (the buffers) with the
devices' weights (:class:`~edge_client.intnn.cuda.stack.Weights`).

What the passes (:mod:`edge_client.intnn.cuda.passes`) ask of a layer: ``cuda_forward``,
and ``cuda_backward`` (a layer without weights: the error at its input) or
``cuda_input_error`` and ``cuda_grad`` (a weight layer: its error at the input and its
weight gradient from its quantized error; the quantization and the update are the
passes'). ``cuda_buffers``: what else it keeps per device and sample (a max-pool's
winners).
"""

from edge_client.intnn.layers.base import PACKAGES

PACKAGES["cuda"] = __name__
