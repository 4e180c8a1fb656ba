"""``python -m meshserve.cli``: the same as the ``meshserve`` console script."""

from meshserve.cli import main

main()
