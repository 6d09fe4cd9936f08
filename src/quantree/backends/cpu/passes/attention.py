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


HEADS_SPLIT = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _swaps_heads(n: object, rank: int = 4) -> bool:
    """``n`` is ``transpose(1, 2)`` or ``permute(0, 2, 1, 3)`` of a 4-d value."""
    if not isinstance(n, fx.Node) or n.kwargs:
        return False
    a: Any = n.args
    if n.target == aten.transpose.int and len(a) == 3:
        return all(isinstance(d, int) for d in a[1:]) and {a[1] % rank, a[2] % rank} == {1, 2}
    if n.target == aten.permute.default and len(a) == 2:
        return [d % rank for d in a[1]] == [0, 2, 1, 3]
    return False


def _heads(x: object, shapes: dict[fx.Node, Any]) -> tuple[fx.Node, fx.Node, Any, int, int] | None:
    """``(view, source, rows, heads, features)`` where ``x`` is ``source [B, S, H D]`` viewed
    as ``[B, S, H, D]`` and its heads moved second, read by nothing else: head ``h`` is then
    columns ``h D .. (h + 1) D`` of ``source``'s ``B S`` rows, as a program slot holds them."""
    if not _swaps_heads(x):
        return None
    assert isinstance(x, fx.Node)
    view = x.args[0]
    if not isinstance(view, fx.Node) or view.target not in HEADS_SPLIT or len(view.users) != 1:
        return None
    source: Any = view.args[0]
    src, split = shapes.get(source), shapes.get(view)
    if src is None or split is None or src[1] != torch.float32 or split[1] != torch.float32:
        return None
    (dims, four) = src[0], split[0]
    if len(dims) != 3 or len(four) != 4 or not all(type(d) is int for d in four[1:]):
        return None
    b, s, width = dims
    if four[0] != b or four[1] != s or four[2] * four[3] != width:
        return None
    assert isinstance(source, fx.Node)
    return view, source, s, four[2], four[3]


def program_form(
    n: fx.Node, shapes: dict[fx.Node, Any], inside: set[fx.Node] | None = None
) -> dict[str, Any] | None:
    """How a region program runs ``quantree.attention`` node ``n`` (its ``ATTENTION``
    instruction, ``csrc/qt_program.h``), or None. The form is the one BERT-like encoders
    write: q, k and v are heads of ``[B, S, H D]`` values (``_heads``), the output is laid
    out heads-last and read only by ``transpose(1, 2)`` (the heads merged back), the mask is
    none or float ``[B | 1, 1, Sq | 1, Sk]``. Then the heads' views and transposes on both
    sides are column blocks of 2-d slots: no copies, and the whole encoder layer (q/k/v
    projection, attention, output projection, residual adds, layer norms, feed-forward) is
    one program. ``inside``: the nodes before ``n`` the program already runs (the heads'
    views must be among them)."""
    a: Any = n.args
    if n.target != torch.ops.quantree.attention.default or len(a) != 6 or not a[5]:
        return None
    if len(n.users) != 1 or not _swaps_heads(next(iter(n.users))):
        return None
    parts = [_heads(x, shapes) for x in a[:3]]
    if any(p is None for p in parts):
        return None
    (qv, q, sq, h, d), (kv, k, sk, hk, dk), (vv, v, sv, hv, dv) = parts  # type: ignore[misc]
    if (hk, dk, hv, sv) != (h, d, h, sk) or not isinstance(sq, int) or not isinstance(sk, int):
        return None
    batch = shapes[q][0][0]
    if shapes[k][0][0] != batch or shapes[v][0][0] != batch:
        return None
    if inside is not None and not all(x in inside for x in (*a[:3], qv, kv, vv)):
        return None
    if any(set(x.users) != {n} for x in a[:3]):
        return None
    mask, mode = a[3], -1
    if mask is not None:
        m = shapes.get(mask)
        if m is None or m[1] != torch.float32 or len(m[0]) != 4:
            return None
        mb, mh, mq, mk = m[0]
        if mh != 1 or mk != sk or mq not in (1, sq) or (mb != 1 and mb != batch):
            return None
        if mq == sq and sq != 1:
            mode = 2 if mb == batch else (2 if batch == 1 else -2)
        else:
            mode = 0 if mb == batch else 1
        if mode == -2:
            return None
    return {
        "q": q, "k": k, "v": v, "mask": mask, "mode": mode, "scale": float(a[4]),
        "heads": h, "sq": sq, "sk": sk, "d": d, "dv": dv, "batch": batch,
        "splits": [*a[:3], qv, kv, vv],
    }  # fmt: skip
