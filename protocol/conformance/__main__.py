"""python -m protocol.conformance: the Model Server Protocol suite."""

from protocol.conformance.cli import main

main()
