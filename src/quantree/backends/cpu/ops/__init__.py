"""quantree's int8 CPU ops, registered as ``torch.ops.quantree.*`` custom ops.

They take and return plain tensors (int8 activations, packed int8 weights, int32 offsets,
float scales), have fake implementations, and so survive ``torch.export`` and
``torch.export.save``/``load``: importing ``quantree.backends`` (or this module) registers
them, nothing else of quantree is needed to run a loaded model.
"""

from quantree.backends.cpu.ops.affine import channel_affine
from quantree.backends.cpu.ops.conv_transpose import conv_transpose, conv_transpose16
from quantree.backends.cpu.ops.elementwise import binary, dequantize, lookup, quantize, softmax
from quantree.backends.cpu.ops.embedding import embedding_rows
from quantree.backends.cpu.ops.gemm import conv1d, conv2d, linear, matmul
from quantree.backends.cpu.ops.group_norm import group_norm
from quantree.backends.cpu.ops.mean import mean_hw
from quantree.backends.cpu.ops.pool import avg_pool2d, max_pool2d
from quantree.backends.cpu.ops.program import program
from quantree.backends.cpu.ops.rnn import PER_LAYER, RNN_KINDS, rnn
from quantree.backends.cpu.ops.rnn_cell import rnn_cell
from quantree.backends.cpu.ops.rnn_packed import rnn_packed_sequence
from quantree.backends.cpu.ops.wide import conv16, linear16
from quantree.backends.cpu.saved.derived_ops import derived_bias, derived_offset, derived_scale

__all__ = [
    "PER_LAYER",
    "RNN_KINDS",
    "avg_pool2d",
    "binary",
    "channel_affine",
    "conv16",
    "conv1d",
    "conv2d",
    "conv_transpose",
    "conv_transpose16",
    "derived_bias",
    "derived_offset",
    "derived_scale",
    "dequantize",
    "embedding_rows",
    "group_norm",
    "linear",
    "linear16",
    "lookup",
    "matmul",
    "max_pool2d",
    "mean_hw",
    "program",
    "quantize",
    "rnn",
    "rnn_cell",
    "rnn_packed_sequence",
    "softmax",
]
