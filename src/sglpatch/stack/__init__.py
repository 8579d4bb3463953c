"""The stack: the patched branch built from the series (`build`: apply), written back as the series
(`export`), and compared with it (`status`: status, check, the blobs the series touches)."""
