"""python -m harness.conformance: the Model Server Protocol suite."""

from harness.conformance.cli import main

main()
