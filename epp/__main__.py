"""python -m epp: the Endpoint Picker."""

from epp.cli import main

main()
