"""python -m epp.conformance: the gateway data-path suite."""

from epp.conformance.cli import main

main()
