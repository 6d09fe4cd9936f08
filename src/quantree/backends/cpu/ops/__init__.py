"""quantree's int8 CPU ops, registered as ``torch.ops.quantree.*`` custom ops.

They take and return plain tensors (int8 activations, packed int8 weights, int32 offsets,
float scales), have fake implementations, and so survive ``torch.export`` and
``torch.export.save``/``load``: importing ``quantree.backends`` (or this module) registers
them, nothing else of quantree is needed to run a loaded model.

``OPS`` is the one list of the native op modules: each registers its ops when imported and
declares the C entry points it calls (``SIGNATURES``, called through ``kernels()``); the
kernels' sources are every ``.cpp`` in ``native/csrc``. Adding an op is a module here, a line
in ``OPS``, a ``.cpp``, a rule, and a line in ``backend.py``'s rule tuple
(``docs/adding-an-op.md``). The package also re-exports each op's Python implementation by
name (``ops.linear``), which shadows the module of the same name: reach the modules
through ``OPS``.
"""

from quantree.backends.cpu.cells import program as cell_loop
from quantree.backends.cpu.cells import program_loop as program_loop_op
from quantree.backends.cpu.ops import affine as affine_op
from quantree.backends.cpu.ops import conv1d as conv1d_op
from quantree.backends.cpu.ops import conv1d_w16 as conv1d_w16_op
from quantree.backends.cpu.ops import conv_transpose as conv_transpose_op
from quantree.backends.cpu.ops import cumsum as cumsum_op
from quantree.backends.cpu.ops import elementwise as elementwise_op
from quantree.backends.cpu.ops import embedding as embedding_op
from quantree.backends.cpu.ops import gemm as gemm_op
from quantree.backends.cpu.ops import group_norm as group_norm_op
from quantree.backends.cpu.ops import norm_block as norm_block_op
from quantree.backends.cpu.ops import pad as pad_op
from quantree.backends.cpu.ops import pool as pool_op
from quantree.backends.cpu.ops import program as program_op
from quantree.backends.cpu.ops import wide as wide_op
from quantree.backends.cpu.ops.affine import channel_affine
from quantree.backends.cpu.ops.composite import attention as attention_op
from quantree.backends.cpu.ops.composite.attention import attention
from quantree.backends.cpu.ops.conv1d_w16 import conv1d_w16
from quantree.backends.cpu.ops.conv_transpose import conv_transpose, conv_transpose16
from quantree.backends.cpu.ops.elementwise import (
    binary,
    dequantize,
    glu,
    lookup,
    quantize,
    softmax,
)
from quantree.backends.cpu.ops.embedding import embedding_rows
from quantree.backends.cpu.ops.gemm import conv1d, conv2d, linear, matmul
from quantree.backends.cpu.ops.group_norm import group_norm
from quantree.backends.cpu.ops.norm_block import norm_block
from quantree.backends.cpu.ops.pad import pad_last
from quantree.backends.cpu.ops.pool import avg_pool2d, max_pool2d, mean_hw
from quantree.backends.cpu.ops.program import program
from quantree.backends.cpu.ops.recurrent import rnn as rnn_op
from quantree.backends.cpu.ops.recurrent import rnn_cell as rnn_cell_op
from quantree.backends.cpu.ops.recurrent import rnn_packed as rnn_packed_op
from quantree.backends.cpu.ops.recurrent.rnn import PER_LAYER, RNN_KINDS, rnn
from quantree.backends.cpu.ops.recurrent.rnn_cell import rnn_cell
from quantree.backends.cpu.ops.recurrent.rnn_packed import rnn_packed_sequence
from quantree.backends.cpu.ops.wide import conv16, linear16
from quantree.backends.cpu.saved import derived_ops, nibbles
from quantree.backends.cpu.saved.derived_ops import derived_bias, derived_offset, derived_scale

OPS = (
    affine_op,
    attention_op,
    cell_loop,
    conv1d_op,
    conv1d_w16_op,
    conv_transpose_op,
    cumsum_op,
    derived_ops,
    elementwise_op,
    embedding_op,
    gemm_op,
    group_norm_op,
    nibbles,
    norm_block_op,
    pad_op,
    pool_op,
    program_op,
    program_loop_op,
    rnn_op,
    rnn_cell_op,
    rnn_packed_op,
    wide_op,
)
"""Every module that defines ``torch.ops.quantree`` ops (the cell loops' in ``cells/``, the
derived constants' and 4-bit weights' in ``saved/``)."""

__all__ = [
    "OPS",
    "PER_LAYER",
    "RNN_KINDS",
    "attention",
    "avg_pool2d",
    "binary",
    "channel_affine",
    "conv16",
    "conv1d",
    "conv1d_w16",
    "conv2d",
    "conv_transpose",
    "conv_transpose16",
    "derived_bias",
    "derived_offset",
    "derived_scale",
    "dequantize",
    "glu",
    "embedding_rows",
    "group_norm",
    "linear",
    "linear16",
    "lookup",
    "matmul",
    "max_pool2d",
    "mean_hw",
    "norm_block",
    "pad_last",
    "program",
    "quantize",
    "rnn",
    "rnn_cell",
    "rnn_packed_sequence",
    "softmax",
]
