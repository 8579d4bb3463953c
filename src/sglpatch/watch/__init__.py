"""`sglpatch watch`: the series against every upstream release after the pin.

One row per release, one column per patch (the classification is rebase's own, see
``rebase.classify``), plus the release's dependency pins next to the pinned release's and the
newest release of each on the index; for the packages the series relies on (deps/newer.toml),
what their newest release changes of what the newest watched release uses (watch.depwatch).
Trees are cached (``sglpatch.upstream.treecache``): each registry artifact is unpacked once into a
cache git repository, so a second run only classifies. Output: a terminal table, and optionally JSON and markdown.
Exit status: 3 when the newest release needs a human, else 0.

Modules: ``matrix`` (the rows: classification, pins, what newer dependencies change), ``render``
(the terminal table, the markdown), ``supersede`` (the ``X-Superseded-By`` probe), ``depwatch``
(dependencies newer than the pins).
"""
