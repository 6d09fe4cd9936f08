"""What region programs' instructions are made of, apart from the pass that fuses regions
(``passes/regions.py``): row layouts (``region_layout``), float math (``region_math``) and
strided moves, running sums and triangular fills (``region_strided``)."""
