"""`python -m app.cli`: how the servers and ranks started from here run `ngrammys`."""

from app.cli import main

main()
