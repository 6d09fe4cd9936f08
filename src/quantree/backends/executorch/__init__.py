"""ExecuTorch export: the reference graph lowered with XNNPACK and written as a ``.pte``.

``qt.export_executorch(ref, example_args, "model.pte")``; ``run_executorch(path, args)``
runs it with ExecuTorch's runtime. Needs the ``executorch`` package (see ``export.INSTALL``).
"""

from quantree.backends.executorch.export import (
    Delegation,
    Lowered,
    export_executorch,
    lower_executorch,
    run_executorch,
)

__all__ = ["Delegation", "Lowered", "export_executorch", "lower_executorch", "run_executorch"]
