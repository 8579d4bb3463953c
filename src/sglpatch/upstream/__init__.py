"""Getting the upstream tree: the pin (`pin`, upstream.lock), the package index (`pkgindex`), release
files downloaded and verified (`artifacts`), an sdist as a git tree (`unpack`), registry trees unpacked
once (`treecache`) under the cache folder (`cachedir`), and the pinned tree made branch `upstream` of a
workdir (`materialize`)."""
