"""``quantree demo``: quantize the bundled character-level LSTM and show what it costs.

Every quantized configuration is one entry of ``VARIANTS`` (a name, a quantizer factory, an
optional backend); a variant whose API is not in this build (``requires``) is skipped, so a
new recipe or backend appears in the table by adding one line. Each one is labelled by how it
runs: ``simulated (q/dq)`` (the reference graph: float ops between quantize/dequantize, which
measures accuracy, not speed) or ``int8 kernels`` (lowered to the CPU backend's native ops).
The default run (``DEFAULT_VARIANTS``) takes under a minute; ``quantree demo --all`` adds the
cells-mode and a16w8 recipes, whose simulations run step by step in Python.
"""

from __future__ import annotations

import copy
import importlib
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantree.core.calibrate import calibrate
from quantree.core.convert import convert
from quantree.core.lower import REFERENCE, Backend, lower
from quantree.core.prepare import prepare
from quantree.core.quantizer import Quantizer
from quantree.core.specs import QDtype
from quantree.recipes.int8 import A16W8Quantizer, Int8Quantizer, RecurrentMode
from quantree.recurrent.capture import capture
from quantree.tools.compare import Comparison, compare
from quantree.tools.inspection import summary
from quantree.tools.measure import latencies_ms, model_bytes, torch_threads
from quantree.tools.metrics import sqnr_from_energies
from quantree.workloads import batches, bits_per_char, load_charlm, load_corpus

BATCH, SEQ = 16, 128
SIMULATED, KERNELS, FLOAT = "simulated (q/dq)", "int8 kernels", "float"
DEFAULT_REPORT = Path("quantree-report") / "report.html"


def _resolve(name: str) -> tuple[object | None, str]:
    """``quantree.<name>`` (dotted: ``backends.CPU``) and, when missing, why."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(f"quantree.{module_name}" if module_name else "quantree")
    except ImportError:
        return None, f"needs quantree.{name}"
    except Exception as error:  # a module that exists but fails to load (a native build)
        return None, f"quantree.{module_name} failed to load: {type(error).__name__}: {error}"
    found = getattr(module, attr, None)
    return found, "" if found is not None else f"needs quantree.{name}"


def int8_whole() -> Quantizer:
    return Int8Quantizer()


def int8_cells_int16_cell() -> Quantizer:
    return Int8Quantizer(recurrent=RecurrentMode.CELLS, cell_state_dtype=QDtype.INT16)


def integer_lstm() -> Quantizer:
    return Int8Quantizer(
        recurrent=RecurrentMode.CELLS,
        cell_state_dtype=QDtype.INT16,
        gate_dtype=QDtype.INT16,
    )


def a16w8() -> Quantizer:
    return A16W8Quantizer()


def cpu_backend() -> Backend:
    backend, _ = _resolve("backends.CPU")
    assert isinstance(backend, Backend)
    return backend


@dataclass(frozen=True)
class Variant:
    """One row of the demo: a recipe, and the backend its reference graph is lowered for."""

    name: str
    quantizer: Callable[[], Quantizer]
    backend: Callable[[], Backend] | None = None
    requires: tuple[str, ...] = ()
    default: bool = False  # in the default (under a minute) run; all run with --all

    @property
    def kind(self) -> str:
        """How the variant runs: ``int8 kernels`` when lowered, else ``simulated (q/dq)``."""
        return KERNELS if self.backend is not None else SIMULATED

    @property
    def missing(self) -> str:
        """Why this build cannot run the variant ('' when it can)."""
        reasons = [_resolve(name)[1] for name in self.requires]
        return "; ".join(r for r in reasons if r)

    @property
    def available(self) -> bool:
        return not self.missing


_CPU = ("backends.CPU",)
VARIANTS: tuple[Variant, ...] = (
    Variant("int8 whole", int8_whole, default=True),
    Variant("int8 cells, int16 cell", int8_cells_int16_cell, requires=("RecurrentMode",)),
    Variant("integer LSTM (cells)", integer_lstm, requires=("RecurrentMode",)),
    Variant("a16w8 whole", a16w8, requires=("A16W8Quantizer",)),
    Variant("int8 whole, CPU kernels", int8_whole, cpu_backend, requires=_CPU, default=True),
    Variant("integer LSTM, CPU kernels", integer_lstm, cpu_backend, requires=_CPU),
)
DEFAULT_VARIANTS: tuple[Variant, ...] = tuple(v for v in VARIANTS if v.default)


@dataclass(frozen=True)
class DemoRow:
    variant: str
    bits_per_char: float
    logits_sqnr_db: float
    latency_ms: float
    size_bytes: int
    calibrate_s: float = 0.0  # calibration of the recipe (shared by its backends)
    quantize_s: float = 0.0  # capture + prepare + calibrate + convert + lower
    note: str = ""
    kind: str = SIMULATED  # FLOAT, SIMULATED or KERNELS


@dataclass
class DemoResult:
    rows: list[DemoRow] = field(default_factory=list)
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    calibration_batches: int = 0
    eval_chars: int = 0
    compare_batches: int = 0
    seconds: float = 0.0
    failures: dict[str, str] = field(default_factory=dict)
    summaries: dict[str, str] = field(default_factory=dict)  # inspection.summary per variant

    def row(self, variant: str) -> DemoRow:
        return next(r for r in self.rows if r.variant == variant)


@dataclass(frozen=True)
class _Calibrated:
    prepared: torch.fx.GraphModule  # float-exact: the reference compare() reads cells from
    converted: torch.fx.GraphModule
    calibrate_s: float
    quantize_s: float


def _calibrated(
    model: torch.nn.Module,
    variant: Variant,
    calibration: list[tuple[torch.Tensor]],
    progress: bool,
) -> _Calibrated:
    """Capture, prepare, calibrate (with a progress bar) and convert for ``variant``."""
    start = time.perf_counter()
    prepared = prepare(capture(model, calibration[0]), variant.quantizer())
    data = tqdm(
        calibration,
        desc=f"calibrating {variant.name}",
        unit="batch",
        disable=not progress,
        leave=False,
    )
    cal_start = time.perf_counter()
    calibrate(prepared, data, progress=False)
    cal_s = time.perf_counter() - cal_start
    converted = convert(prepared)
    return _Calibrated(prepared, converted, cal_s, time.perf_counter() - start)


def _output_sqnr_db(
    model: torch.nn.Module, qmodel: torch.nn.Module, probes: list[tuple[torch.Tensor]]
) -> float:
    """SQNR of ``qmodel``'s first output against ``model``'s over ``probes`` (the logits)."""
    signal = noise = 0.0
    for probe in probes:
        want, got = model(*probe), qmodel(*probe)
        want = want[0] if isinstance(want, tuple) else want
        got = got[0] if isinstance(got, tuple) else got
        signal += float(want.double().square().sum())
        noise += float((want.double() - got.double()).square().sum())
    return sqnr_from_energies(signal, noise)


def run_demo(
    calibration_batches: int = 50,
    eval_chars: int = 100_000,
    *,
    compare_batches: int = 2,
    variants: tuple[Variant, ...] = DEFAULT_VARIANTS,
    progress: bool | None = None,
    log: Callable[[str], None] = print,
) -> DemoResult:
    """Quantize the bundled model with every available variant and measure each one.

    ``progress=None`` shows calibration progress bars only when stderr is a terminal, so
    output redirected to a file or pipe holds no carriage-return redraws.
    """
    start = time.perf_counter()
    if progress is None:
        progress = sys.stderr.isatty()
    result = DemoResult(
        calibration_batches=calibration_batches,
        eval_chars=eval_chars,
        compare_batches=compare_batches,
    )
    with torch_threads(1), torch.no_grad():
        model = load_charlm("lstm")
        validation = load_corpus("validation")[: eval_chars + 1]
        train = load_corpus("train", max_chars=400_000)
        calibration = batches(train, BATCH, SEQ, calibration_batches, seed=0)
        probes = batches(validation, BATCH, SEQ, compare_batches, seed=1)
        probe = probes[0]

        variant_names = {v.name for v in variants}
        timed: dict[str, torch.nn.Module] = {}

        def measure(
            name: str, qmodel: torch.nn.Module, reference: torch.fx.GraphModule | None
        ) -> tuple[float, float, float, int]:
            logits_db = float("inf")
            if reference is None and qmodel is not model:
                logits_db = _output_sqnr_db(model, qmodel, probes)
            elif reference is not None:
                comparison = compare(reference, qmodel, probes)
                if name in variant_names:  # the report charts quantree's variants
                    result.comparisons[name] = comparison
                logits_db = comparison.outputs[0].sqnr_db if comparison.outputs else math.nan
            bpc = bits_per_char(qmodel, validation, SEQ, BATCH)
            timed[name] = qmodel
            return bpc, logits_db, math.nan, model_bytes(qmodel)

        bpc, _, ms, size = measure("float", model, None)
        result.rows.append(DemoRow("float", bpc, float("inf"), ms, size, kind=FLOAT))
        log(f"float: {bpc:.4f} bits/char")
        with warnings.catch_warnings():  # torch deprecates its quantized tensor types
            warnings.simplefilter("ignore", UserWarning)
            dynamic = torch.ao.quantization.quantize_dynamic(
                copy.deepcopy(model), {torch.nn.LSTM, torch.nn.Linear}, dtype=torch.qint8
            )
            dynamic(*probe)
        bpc, db, ms, size = measure("torch dynamic int8", dynamic, None)
        result.rows.append(
            DemoRow("torch dynamic int8", bpc, db, ms, size, note="baseline", kind=KERNELS)
        )

        done: dict[Callable[[], Quantizer], _Calibrated] = {}
        for variant in variants:
            if not variant.available:
                log(f"{variant.name}: skipped ({' '.join(variant.missing.split())[:200]})")
                continue
            try:
                if variant.quantizer not in done:
                    done[variant.quantizer] = _calibrated(model, variant, calibration, progress)
                recipe = done[variant.quantizer]
                lower_start = time.perf_counter()
                backend = variant.backend() if variant.backend is not None else REFERENCE
                qmodel = lower(recipe.converted, backend)
                quant_s = recipe.quantize_s + time.perf_counter() - lower_start
                bpc, db, ms, size = measure(variant.name, qmodel, recipe.prepared)
            except Exception as error:  # one broken optional variant must not end the demo
                message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
                result.failures[variant.name] = message
                log(f"{variant.name}: failed ({message})")
                continue
            cal_s = recipe.calibrate_s
            if isinstance(qmodel, torch.fx.GraphModule):
                result.summaries[variant.name] = summary(qmodel, f"{variant.name} [{variant.kind}]")
            row = DemoRow(variant.name, bpc, db, ms, size, cal_s, quant_s, kind=variant.kind)
            result.rows.append(row)
            log(
                f"{variant.name} [{variant.kind}]: calibrated {calibration_batches} batches "
                f"in {cal_s:.1f} s, "
                f"{bpc:.4f} bits/char, logits {db:.1f} dB"
            )
        log(f"timing {len(timed)} models, one forward of {BATCH}x{SEQ} chars at a time ...")
        latency = latencies_ms(timed, probe)
        result.rows = [replace(r, latency_ms=latency[r.variant]) for r in result.rows]
    result.seconds = time.perf_counter() - start
    return result
