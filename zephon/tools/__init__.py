"""Tools on top of everything: the ``zephon`` command, batch display and provenance, plots, the
bundled demo and the synthetic corpora it generates."""
