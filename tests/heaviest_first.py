"""The order in which ``--dist loadfile`` hands test files to the xdist workers: heaviest first.

xdist hands out files in collection order, so a heavy file collected late (the kernel check,
the fuzzer) pins one worker at the end while the other has long finished: on 2 workers the
run took the longest worker's sum, not half the total. Here each free worker takes the
heaviest file left (longest processing time first), so the light files fill in at the end
and the two workers finish together. Nothing about what runs changes: the same files, each
whole on one worker (its module fixtures built once), in its own order.

The native-build files also share one unit (``NATIVE_BUILDS``): they compile the same
objects (the baseline and ``-march=native`` kernels, the ISA files every x86 build shares),
and the run's object cache (``conftest.py``) serves a build only what an earlier one finished,
so run side by side on two workers each compiled everything.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

NATIVE_BUILDS = "native builds"
"""The unit of the files that compile the kernel library (one worker, one after another)."""
BUILD_FILES = {
    "tests/backends/test_kernel_check.py",
    "tests/backends/test_prebuilt.py",
    "tests/backends/test_kernels.py",
    "tests/backends/test_native_build.py",
}
SECONDS: dict[str, float] = {
    "tests/backends/test_onnx_export.py": 120,
    "tests/backends/test_onnx_packed.py": 190,
    "tests/backends/test_kernel_check.py": 150,
    "tests/backends/test_step_program.py": 105,
    "tests/tools/test_compare_property.py": 125,
    "tests/tools/test_file_fuzz.py": 85,
    "tests/tools/test_cli.py": 60,
    "tests/backends/test_onnx_onnxruntime.py": 60,
    "tests/backends/test_kernels.py": 50,
    "tests/end_to_end/test_workload_accuracy.py": 50,
    "tests/backends/test_prebuilt.py": 45,
    "tests/backends/test_executorch_export.py": 45,
    "tests/backends/test_native_build.py": 40,
    "tests/backends/test_saved_size.py": 40,
    "tests/backends/test_native_checks.py": 35,
    "tests/core/test_distributed_calibration.py": 30,
    "tests/backends/test_executorch_recurrent.py": 30,
    "tests/tools/test_demo.py": 25,
    "tests/backends/test_isa.py": 20,
    "tests/backends/test_native_guard.py": 20,
}
"""Rough cost of the files that take longest (seconds, a file's tests summed: the slowest
tests of the CI runs in benchmarks/README.md, "h-ci15"; test_onnx_export.py and
test_step_program.py: the CPU seconds of the file alone after "h-citests"). Only the order
depends on them: a file missing here (new, renamed) is estimated from its number of tests."""
PER_TEST = 0.4
"""Seconds a test of a file not in ``SECONDS`` is taken to cost (the suite's mean, the files
above left out)."""


class HeaviestFirst(LoadFileScheduling):
    """``loadfile``, with the heaviest unit left given to each worker that asks for one."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return NATIVE_BUILDS if path in BUILD_FILES else path

    def _assign_work_unit(self, node: WorkerController) -> None:
        heaviest = max(self.workqueue, key=lambda scope: self._cost(scope))
        self.workqueue.move_to_end(heaviest, last=False)
        super()._assign_work_unit(node)

    def _cost(self, scope: str) -> float:
        if scope == NATIVE_BUILDS:
            return sum(SECONDS.get(path, 0.0) for path in BUILD_FILES)
        return SECONDS.get(scope, PER_TEST * len(self.workqueue[scope]))
