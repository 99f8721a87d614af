"""``python -m tollgate``: the same as the ``tollgate`` command (used by ``tollgate up`` for its children)."""

from tollgate.cli import main

main()
