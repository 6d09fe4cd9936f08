"""``CPU``: the native int8 backend (VNNI kernels built on first use).

Rules, tried in order at each node: whole recurrent layers, recurrent cells (one step),
linear(+relu), conv(+relu), int8 data movement, cat/stack, masked_fill, max pooling,
int8 add/mul/sub/matmul, pointwise tables, GLU, softmax.
Cells-mode cell bodies are lowered with the same rules, then each cell loop runs as one
native program when its lowered body compiles to one. The remaining quantize/dequantize
nodes become native ones, and the module keeps only the tensors its graph still reads, so
the reference graph's int8 weights are not stored twice.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.fx as fx

from quantree.backends.cpu.cells.float_masks import call_of, cast_sources, float_masks
from quantree.backends.cpu.cells.layer import NativeRecurrentCells
from quantree.backends.cpu.cells.program import NativeCellLoop, compile_body
from quantree.backends.cpu.cells.step_loop import native_step_loop
from quantree.backends.cpu.cells.step_program import native_program_loop
from quantree.backends.cpu.native.chains import run_chains_natively
from quantree.backends.cpu.native.direct import call_directly
from quantree.backends.cpu.native.fast_attributes import read_buffers_directly
from quantree.backends.cpu.native.flat_inputs import bind_flat_inputs
from quantree.backends.cpu.native.loader import library
from quantree.backends.cpu.passes.attention import fuse_attention
from quantree.backends.cpu.passes.casts import drop_identity_casts
from quantree.backends.cpu.passes.dequantized_constants import fold_dequantized_constants
from quantree.backends.cpu.passes.dropout import drop_eval_dropout
from quantree.backends.cpu.passes.float_report import warn_float_ops
from quantree.backends.cpu.passes.fold import fold_input_independent
from quantree.backends.cpu.passes.norm_blocks import fuse_norm_blocks
from quantree.backends.cpu.passes.packed_qkv import split_packed_qkv
from quantree.backends.cpu.passes.per_shape import compute_once_per_shape
from quantree.backends.cpu.passes.regions import fuse_regions
from quantree.backends.cpu.passes.rms_norm import recognise_rms_norm
from quantree.backends.cpu.passes.shared_constants import share_identical
from quantree.backends.cpu.passes.sibling_linears import merge_sibling_linears
from quantree.backends.cpu.passes.simulated import simulated_ops, warn_simulated
from quantree.backends.cpu.rules.cat import lower_cat
from quantree.backends.cpu.rules.composite.global_norm import lower_global_norm
from quantree.backends.cpu.rules.composite.glu import lower_glu
from quantree.backends.cpu.rules.conv1d_w16 import lower_conv1d_w16
from quantree.backends.cpu.rules.conv_transpose import lower_conv_transpose
from quantree.backends.cpu.rules.cumsum import lower_cumsum
from quantree.backends.cpu.rules.embedding import lower_embedding
from quantree.backends.cpu.rules.linear import lower_conv2d, lower_linear
from quantree.backends.cpu.rules.masked_fill import lower_masked_fill
from quantree.backends.cpu.rules.movement.pad import lower_pad
from quantree.backends.cpu.rules.norm import lower_batch_norm, lower_group_norm
from quantree.backends.cpu.rules.pool import lower_avg_pool, lower_mean
from quantree.backends.cpu.rules.qdq import (
    lower_binary,
    lower_matmul,
    lower_max_pool,
    lower_movement,
    lower_pointwise,
    lower_softmax,
    native_quantize_dequantize,
)
from quantree.backends.cpu.rules.recurrent.cells import lower_cell
from quantree.backends.cpu.rules.recurrent.layers import (
    float_outputs_read_by_dequantize,
    recurrent_rule,
)
from quantree.backends.cpu.rules.recurrent.packed_sequence import (
    lower_gather,
    lower_metadata_reads,
    lower_packing,
)
from quantree.backends.cpu.rules.views import lower_requantized_views, lower_view_chain
from quantree.backends.cpu.rules.wide import lower_wide
from quantree.backends.cpu.saved.pickling import refuse_pickling
from quantree.backends.cpu.speed_check import FLOAT_COSTS_KEY, check_speed, note_float_costs
from quantree.core.errors import QuantreeWarning
from quantree.core.graphs import nested_graphs, replace_submodule
from quantree.core.lower import Backend, LoweringRule, lower
from quantree.core.stages import GROUPS_KEY
from quantree.recurrent.loop import CellLoop, RecurrentCells
from quantree.recurrent.unrolled.step_loop import StepLoop


def finish(
    gm: fx.GraphModule,
    nested: Backend | None = None,
    attention: bool = True,
    speed_check: bool = False,
) -> fx.GraphModule:
    """Lower nested graphs, native q/dq for what is left, identical constants stored once,
    keep only the tensors read; name what still computes in float (``float_report``) and,
    with ``speed_check``, say if the model would be no faster than float (``speed_check.py``).

    Loads the native kernels first, so that a machine which cannot build or load them
    gets a ``QuantreeError`` saying why at lowering, not a raw error at the first inference.
    """
    library()
    priced = gm.meta.pop(FLOAT_COSTS_KEY, None)  # the reference, priced before the rules
    if nested is not None:
        lower_nested(gm, nested)
        fold_dequantized_constants(gm)  # a float op's int8 weight: dequantized once, here
    native_quantize_dequantize(gm)
    float_outputs_read_by_dequantize(gm)  # a layer's output dequantized: written float
    if nested is not None:  # the top-level graph: one warning for the model
        fold_input_independent(gm)  # masks built from zeros/ones on every call, built once
        split_packed_qkv(gm)  # nn.MultiheadAttention's q/k/v split: column slices
        drop_identity_casts(gm)  # float32 .to(float32) and its check: no region cut there
        drop_eval_dropout(gm)  # eval-mode dropout returns its input: no call, no cut
        if attention:
            merge_sibling_linears(gm)  # q, k, v projections of one input: one linear16
            fuse_attention(gm)  # float softmax(q k^T * c + mask) v: one native call
        recognise_rms_norm(gm)  # LLaMA/T5's five-op RMSNorm: one op, one program instruction
        fuse_norm_blocks(gm)  # group norm -> gelu/glu -> scale -> + x: one native call
        fuse_regions(gm)  # runs of small ops, one native call each (cell bodies have theirs)
        # after fusion: an op a program now runs is named once, by the float-op warning
        warn_simulated(gm, "cpu")
    share_identical(gm)  # an unrolled decoder's per-call-site weights, stored once
    gm.graph.lint()
    gm.recompile()
    lean = fx.GraphModule(gm, gm.graph, class_name=type(gm).__name__)
    lean.meta = dict(gm.meta)
    if nested is not None:  # the whole model, its nested bodies included: say it once
        # shape arithmetic runs once per input shape: not a float op, not a per-call cost
        compute_once_per_shape(lean)
        warn_float_ops(lean, "the CPU backend", named=set(simulated_ops(gm)))
        if speed_check:
            check_speed(lean, priced)
    done = run_chains_natively(read_buffers_directly(bind_flat_inputs(call_directly(lean))))
    return refuse_pickling(done) if nested is not None else done


def lower_nested(gm: fx.GraphModule, backend: Backend) -> None:
    """Lower every submodule graph that carries quantree's groups (cells-mode cell bodies),
    then run each cell loop whose lowered body compiles as one native program, and each
    layer whose loops all do so on the native layer's short call path (``cells/layer.py``).

    The modules on the path to each replaced one are copied first, so the reference model,
    which shares them, is left as it was.
    """
    for name, body in nested_graphs(gm).items():
        if GROUPS_KEY in body.meta:
            replace_submodule(gm, name, lower(body, backend))
    in_python = []
    for name, module in list(gm.named_modules()):
        if isinstance(module, CellLoop):
            example = tuple(
                torch.zeros(n.meta["val"].shape)
                for n in module.body.graph.nodes
                if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
            )
            program = compile_body(module.body, example) if example else None
            if program is not None:
                replace_submodule(gm, name, NativeCellLoop(program, module.reverse))
            else:
                in_python.append(name)
    for name, module in list(gm.named_modules()):
        if type(module) is RecurrentCells and NativeRecurrentCells.covers(module):
            replace_submodule(gm, name, NativeRecurrentCells(module))
    for name, module in list(gm.named_modules()):
        if not isinstance(module, StepLoop):
            continue
        native = native_step_loop(module) or native_program_loop(module)
        call = call_of(gm, name) if native is None else None
        masked = float_masks(module) if call is not None else None
        if call is not None and masked is not None:
            native = native_program_loop(masked[0])
            if native is not None:
                cast_sources(gm, call, module.n_states, masked[1])
        if native is not None:
            replace_submodule(gm, name, native)
    folded = [name for name, m in gm.named_modules() if isinstance(m, StepLoop)]
    if folded:
        warnings.warn(
            f"{len(folded)} loop(s) folded from a Python loop over time run their lowered step "
            f"step by step in Python, slower than float for small steps: {', '.join(folded)}. "
            "Their lowered steps hold an op or a shape the native step program does not run "
            "(cells/step_program.py); quantize with "
            "fold_loops=False to keep the unrolled steps (fused, but fixed to the captured "
            "length).",
            QuantreeWarning,
            stacklevel=3,
        )
    if in_python:
        warnings.warn(
            f"{len(in_python)} cell loop(s) run their lowered body step by step in Python, "
            f"much slower than float: {', '.join(in_python)}. Their bodies hold ops the "
            "native cell program does not run (int16 inputs to a linear, as A16W8Quantizer "
            "makes); int8 activations with an int16 cell state and gates run natively.",
            QuantreeWarning,
            stacklevel=3,
        )


def cpu_backend(hidden_bits: int = 8, attention: bool = True, speed_check: bool = True) -> Backend:
    """The native CPU backend; ``hidden_bits`` is how recurrent layers feed h back.

    8 (``CPU``): int8 like every other activation, the fastest. 16: int16 split into two
    byte planes, one fused VNNI pass; free at batch 1 (the step is memory bound), a little
    dearer at large batch, and single-layer recurrences then follow the reference much more
    closely (figures: benchmarks/README.md, "Figures moved from docstrings").
    ``attention=False`` leaves float attention blocks as ATen calls instead of one
    ``quantree.attention`` each (``passes/attention.py``), and their q/k/v projections as
    separate linears (``passes/sibling_linears.py``): the comparison's other side.
    ``speed_check=False``: no estimate of the lowered model against float, so no warning
    where it would be no faster (``speed_check.py``; ``speed_of`` then returns None).
    """
    rules: tuple[LoweringRule, ...] = (
        recurrent_rule(hidden_bits),
        lower_cell,
        lower_linear,
        lower_wide,
        lower_conv1d_w16,
        lower_embedding,
        lower_conv2d,
        lower_conv_transpose,
        lower_view_chain,
        lower_movement,
        lower_requantized_views,
        lower_pad,
        lower_gather,
        lower_packing,
        lower_metadata_reads,
        lower_cat,
        lower_masked_fill,
        lower_max_pool,
        lower_mean,
        lower_cumsum,
        lower_avg_pool,
        lower_batch_norm,
        lower_group_norm,
        lower_global_norm,
        lower_binary,
        lower_matmul,
        lower_pointwise,
        lower_glu,
        lower_softmax,
    )
    name = "cpu" if hidden_bits == 8 else f"cpu-h{hidden_bits}"
    name += "" if attention else "-unfused-attention"
    body = Backend(f"{name}-body", rules, prepare_module=finish)
    fin = functools.partial(finish, nested=body, attention=attention, speed_check=speed_check)
    first = (note_float_costs,) if speed_check else ()  # prices the reference as float
    return Backend(name, first + rules, prepare_module=fin)


CPU = cpu_backend()
"""Native int8 CPU kernels: ``qt.lower(ref, CPU)`` or ``qt.quantize(..., backend=CPU)``."""
