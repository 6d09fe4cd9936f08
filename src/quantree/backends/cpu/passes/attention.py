"""Float attention blocks recognised as one ``quantree.attention`` call.

Under the default recipe attention's scores, scale, additive mask, softmax and weighted sum
stay float (the reference graph has no quantize between them), and the lowered graph ran
them as ATen calls with the heads' transposes and a copy around them. The form matched is
the reference graph's own, op for op, so the fused call computes what it computes (float
rounding aside): ``matmul(q, k.transpose(-2, -1))``, then optionally ``* c`` or ``/ c`` for a
number ``c``, then optionally ``+ mask``, then ``softmax`` over the last dimension, then
``matmul(p, v)``; q, k and v float32 ``[batch, heads, rows, features]``, each intermediate
read once. A block whose scores or probabilities are quantized (a quantizer that puts them on
int8 grids) has q/dq nodes between these ops and is not this form: it keeps its int8 ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten
SOFTMAX = (aten.softmax.int, aten._softmax.default)


def _val(n: object) -> torch.Tensor | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _float4(n: object) -> bool:
    val = _val(n)
    return val is not None and val.dtype == torch.float32 and val.dim() == 4


def _sole(n: fx.Node) -> bool:
    return len(n.users) == 1


def _dims(n: object) -> tuple[str, ...]:
    """``n``'s shape as text: symbolic sizes compare by name, without a guard."""
    val = _val(n)
    return tuple(str(d) for d in val.shape) if val is not None else ()


def _same_heads(q: object, k: object, v: object) -> bool:
    """q ``[B, H, Sq, D]``, k ``[B, H, Sk, D]``, v ``[B, H, Sk, Dv]``: nothing broadcast."""
    dq, dk, dv = _dims(q), _dims(k), _dims(v)
    return dq[:2] == dk[:2] == dv[:2] and dq[3] == dk[3] and dk[2] == dv[2]


def _scale(n: fx.Node) -> tuple[fx.Node, float] | None:
    """``(scores, factor)`` when ``n`` multiplies or divides a single-use node by a number."""
    a: Any = n.args
    if n.target not in (aten.mul.Tensor, aten.div.Tensor) or n.kwargs or len(a) != 2:
        return None
    x, c = a
    if n.target == aten.mul.Tensor and not isinstance(x, fx.Node):
        x, c = c, x
    if not isinstance(x, fx.Node) or isinstance(c, bool) or not isinstance(c, (int, float)):
        return None
    if n.target == aten.div.Tensor:
        return (x, 1.0 / c) if c != 0 else None
    return x, float(c)


def _key(t: object) -> fx.Node | None:
    """k where ``t`` is ``k.transpose(-2, -1)`` of a 4-d k."""
    if not isinstance(t, fx.Node) or t.target != aten.transpose.int or len(t.args) != 3:
        return None
    k, d0, d1 = t.args
    if not _float4(k) or not isinstance(d0, int) or not isinstance(d1, int):
        return None
    return k if isinstance(k, fx.Node) and {d0 % 4, d1 % 4} == {2, 3} else None


def _match(softmax: fx.Node) -> dict[str, Any] | None:
    """The block ending at ``softmax``'s reader ``matmul(p, v)``, or None."""
    a: Any = softmax.args
    if len(a) < 2 or not isinstance(a[1], int) or a[1] % 4 != 3 or (len(a) > 2 and a[2]):
        return None
    if not _float4(softmax) or softmax.kwargs or not _sole(softmax):
        return None
    out = next(iter(softmax.users))
    if out.target != aten.matmul.default or out.args[0] is not softmax or out.kwargs:
        return None
    v = out.args[1]
    if not _float4(v) or not _float4(out):
        return None
    block = [out, softmax]  # the nodes the fused call replaces, readers first
    x, mask = a[0], None
    if isinstance(x, fx.Node) and x.target == aten.add.Tensor and not x.kwargs:
        if len(x.args) != 2 or not _sole(x):
            return None
        block.append(x)
        x, mask = x.args
        mval = _val(mask)
        if mval is None or mval.dtype != torch.float32 or mval.dim() > 4:
            return None
    if not isinstance(x, fx.Node) or not _sole(x):
        return None
    scale, scaled = 1.0, _scale(x)
    if scaled is not None:
        block.append(x)
        x, scale = scaled
        if not _sole(x):
            return None
    if x.target != aten.matmul.default or x.kwargs or len(x.args) != 2:
        return None
    q, k = x.args[0], _key(x.args[1])
    if k is None or not _float4(q) or not _float4(x):
        return None
    if not _same_heads(q, k, v) or _dims(x) != _dims(softmax):
        return None  # matmul broadcast q, k or v, or the mask the scores
    block.append(x)
    return {"q": q, "k": k, "v": v, "mask": mask, "scale": scale, "block": block}


def fuse_attention(gm: fx.GraphModule) -> int:
    """Replace each float attention block of ``gm`` by one ``quantree.attention``; returns
    how many. The output is laid out heads-innermost when its one reader is
    ``transpose(1, 2)`` (the heads merged back), so that transpose and the copy after it
    read it as a dense tensor."""
    graph = gm.graph
    found = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SOFTMAX:
            continue
        m = _match(node)
        if m is None:
            continue
        out: fx.Node = m["block"][0]
        users = list(out.users)
        heads_last = (
            len(users) == 1
            and users[0].target == aten.transpose.int
            and {d % 4 for d in users[0].args[1:3] if isinstance(d, int)} == {1, 2}
        )
        with graph.inserting_before(out):
            fused = graph.call_function(
                torch.ops.quantree.attention.default,
                (m["q"], m["k"], m["v"], m["mask"], m["scale"], heads_last),
            )
        fused.meta = dict(out.meta)
        out.replace_all_uses_with(fused)
        key_t = m["block"][-1].args[1]
        for dead in m["block"]:
            graph.erase_node(dead)
        if not key_t.users:  # k's transpose, unless something else reads it
            graph.erase_node(key_t)
        found += 1
    if found:
        graph.lint()
        gm.recompile()
    return found
