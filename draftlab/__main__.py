"""`python -m draftlab`: the draftlab command (draftlab.main)."""
from draftlab.main import main

main()
