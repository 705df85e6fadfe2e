"""python -m modelserver: the reference model server."""

from modelserver.cli import main

main()
